"""Kernel-enforced isolation for the Python sandbox: bubblewrap, an unprivileged uid, seccomp.

One call runs as

    bwrap (as root: builds the namespaces and mounts, then drops every capability
           but the three setpriv needs)
      -> setpriv (switches to the call's own unprivileged uid, clears groups and
                  every capability, sets no_new_privs)
        -> python -I -c <bootstrap>

inside fresh PID, mount, network, IPC, UTS and cgroup namespaces. bwrap runs
privileged (no user namespace) so that it can mount the interpreter from
places only root can traverse (e.g. a pyenv under /root), and so that the
code runs under a real host uid, where RLIMIT_NPROC is enforced. Each
concurrent call takes its own uid from `UID_COUNT` uids starting at the
configured base, leased machine-wide with `flock` (so two calls, even of two
trainers, never share a process budget). The mount namespace holds: fresh /proc and /dev;
a size-capped private tmpfs at /tmp, which is the working directory; and, bound
read-only on top of those (so an interpreter or venv under /tmp still works),
/usr, the interpreter's prefixes and `sys.path` directories, and
/etc/ld.so.cache. Nothing else of the host filesystem is visible. A
seccomp filter (libseccomp through `pyseccomp`) refuses new user namespaces
(`unshare`/`clone` with CLONE_NEWUSER; `clone3` reports ENOSYS so libc falls
back to `clone`) and a few kernel interfaces a Python cell has no use for.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

CLONE_NEWUSER = 0x10000000
UID_COUNT = 1000
"""How many uids (from the base) calls may lease; more concurrent calls than this wait."""
DEFAULT_UID_BASE = 61000
"""61000-61999: inside Debian's 60000-64999 range for globally allocated system users,
which ordinary machines leave unused. Any range of uids that no host process uses works."""
# Kernel interfaces with no use in a Python cell and a history of privilege-escalation bugs.
SECCOMP_REFUSED = (
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


@lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The compiled BPF program bwrap loads before it starts the command (`--seccomp FD`)."""
    import pyseccomp as sc

    flt = sc.SyscallFilter(defaction=sc.ALLOW)  # other architectures' syscalls: libseccomp's default, kill
    for name in ("unshare", "clone"):
        flt.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags live in memory, out of the filter's reach
    for name in SECCOMP_REFUSED:
        flt.add_rule(sc.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as fh:
        flt.export_bpf(fh)
        fh.seek(0)
        return fh.read()


@lru_cache(maxsize=8)
def interpreter_paths(python: str) -> tuple[str, ...]:
    """Directories `python -I` needs (prefixes and `sys.path`), outermost only, outside /usr."""
    probe = subprocess.run(
        [
            python,
            "-I",
            "-c",
            "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
            "sys.base_exec_prefix, *sys.path]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": _SANDBOX_PATH},
    )
    found = sorted({os.path.abspath(p) for p in json.loads(probe.stdout) if p and os.path.exists(p)}, key=len)
    kept: list[str] = []
    for path in found:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in ["/usr", *kept]):
            kept.append(path)
    return tuple(kept)


# Mounted fresh in every jail. They go first, so that an interpreter living below one of them
# (a checkout or venv under /tmp, a pyenv under /dev/shm) is bound on top of the private mount
# instead of being hidden by it.
PRIVATE_MOUNTS = ("/proc", "/dev", "/tmp")


def _mount_args(python: str, disk_bytes: int) -> list[str]:
    """bwrap's filesystem: private /proc, /dev and /tmp, then read-only system and interpreter on top."""
    args = [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "01777",
        "--size",
        str(disk_bytes),
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    made = {"/usr", *PRIVATE_MOUNTS}
    # Mount points bwrap creates itself are mode 0700 when it runs as root: make them traversable.
    for path in ("/etc/ld.so.cache", *interpreter_paths(python)):
        hidden = [m for m in PRIVATE_MOUNTS if path == m or m.startswith(path.rstrip("/") + "/")]
        if hidden:  # binding it would replace the private mount with the host's directory
            raise RuntimeError(
                f"the interpreter {python} needs {path}, which is or holds {hidden[0]}, a directory the jail "
                "mounts privately; install the interpreter (or venv) in a directory of its own"
            )
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind-try" if path.startswith("/etc/") else "--ro-bind", path, path]
    return args + ["--chdir", "/tmp"]


@dataclass
class UidLease:
    """One leased uid; closing the lock file releases it."""

    uid: int
    fd: int

    def release(self) -> None:
        os.close(self.fd)


class UidPool:
    """Machine-wide leases of uids [base, base + UID_COUNT) via flock on one file per uid.

    A lock is held by an open file description, so two threads of one process
    exclude each other too, and a crashed holder's leases vanish with it.
    """

    def __init__(self, base: int) -> None:
        if not 0 < base <= 2**32 - 2 - UID_COUNT:
            raise ValueError(f"uid base {base} out of range")
        self.base = base
        self.dir = os.path.join(tempfile.gettempdir(), f"trace_mega_sandbox_uids.{os.geteuid()}")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(
                f"{self.dir} must be a directory owned by uid {os.geteuid()} and not group/other "
                "writable (someone else could hold the sandbox's uid leases)"
            )

    def acquire(self) -> UidLease:
        while True:
            for uid in range(self.base, self.base + UID_COUNT):
                fd = os.open(os.path.join(self.dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return UidLease(uid, fd)
                except BlockingIOError:
                    os.close(fd)
            time.sleep(0.05)  # all leased: wait for one to come back


def jail_problem() -> Optional[str]:
    """Why this machine cannot run the jail (None when the tools are all there)."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux namespaces, this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "needs to start as root (bwrap builds the namespaces privileged, setpriv then switches the code "
            f"to an unprivileged uid); this process runs as uid {os.geteuid()}"
        )
    for tool, package in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install -y {package})"
    try:
        seccomp_program()
    except (ImportError, OSError, RuntimeError) as err:
        return f"cannot build the seccomp filter ({type(err).__name__}: {err}); needs pyseccomp and libseccomp2"
    return None


def jail_argv(
    python: str, uid: int, disk_bytes: int, env: dict[str, str], seccomp_fd: int, info_fd: int, command: list[str]
) -> list[str]:
    """The full argv of one call: bwrap, then setpriv to `uid`, then `command` (which starts with `python`)."""
    argv = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        *_mount_args(python, disk_bytes),
        "--clearenv",
    ]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += [
        "--seccomp",
        str(seccomp_fd),
        "--info-fd",
        str(info_fd),
        # setpriv needs exactly these to switch uid/gid and empty the bounding set.
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",
        "--cap-add",
        "CAP_SETPCAP",
        "--",
        shutil.which("setpriv") or "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        *command,
    ]
    return argv
