"""A contained Python interpreter for tool calls: one fresh subprocess per call.

Two isolation modes (`Sandbox(isolation=...)`):

* ``"bwrap"`` (the default): the kernel contains the code whatever it does.
  Each call runs under bubblewrap in fresh PID, mount, network, IPC, UTS and
  cgroup namespaces, as its own unprivileged uid, under a seccomp filter
  (`trace_mega.envs.sandbox_jail` describes the layout). The code sees
  only itself (it cannot see or signal the trainer or any other call), a
  read-only filesystem (the system, the interpreter and its packages) except
  a size-capped private /tmp that is its working directory, and a network
  namespace with nothing in it. Constructing a sandbox in this mode fails
  with a message naming what is missing when the machine cannot provide it.
* ``"weak"``: an explicit opt-in for machines without it (logged as a
  warning each time a sandbox is made). The code runs as the trainer's user
  in a new temporary directory, contained only against accidents: the rlimits
  and the audit hook below. Code written to defeat the hook gets out.

In both modes each call runs `python -I` (isolated mode: no user site, no
PYTHON* variables) with an environment holding only PATH, HOME/TMPDIR (= the
working directory), LANG and single-thread BLAS settings, and:

* CPU time: RLIMIT_CPU (soft limit -> SIGXCPU, hard limit one second later -> SIGKILL).
* Wall time: the parent kills the call at the deadline, whatever the code does
  (bwrap: the PID namespace's init, which takes every process of the call
  with it; weak: the process group).
* Memory: RLIMIT_AS per process; allocations beyond it fail with MemoryError.
* Output: stdout and stderr share one pipe that the parent reads with a cap;
  past the cap the call is killed and the output marked truncated.
* Files: RLIMIT_FSIZE caps any file written (SIGXFSZ ignored, so the write
  fails with an OSError); RLIMIT_NOFILE caps open descriptors; bwrap: the
  /tmp tmpfs is `disk_mb` large.
* Processes (bwrap): RLIMIT_NPROC of the call's own uid caps its processes
  and threads together; when the call returns, every process it started has
  exited (the parent waits for the PID namespace to be torn down).
* The audit hook (`sys.addaudithook`, installed before the cell runs) gives
  the first, readable error for what the cell may not do: writing outside
  the working directory, fork/exec/spawn/subprocess, kill, setrlimit,
  sockets and name lookups, ctypes foreign calls. CPython offers no
  in-process boundary, so under bwrap the hook is a courtesy, not a defence.

The tool's behaviour is the same in both modes for code that does not attack
the hook; only what stops attacking code differs.
"""

from __future__ import annotations

import json
import logging
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from trace_mega.envs.sandbox_jail import DEFAULT_UID_BASE, UidPool, jail_argv, jail_problem, seccomp_program

logger = logging.getLogger(__name__)
ISOLATIONS = ("bwrap", "weak")
WEAK_WARNING = (
    "Sandbox isolation='weak': model-written code runs as this process's user, contained only by rlimits and a "
    "Python audit hook. Code written to defeat the hook can read and write this user's files, reach the network "
    "and signal this process. Use isolation='bwrap' (bubblewrap, run as root) for untrusted code."
)
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_TEARDOWN_S = 10.0  # how long the parent waits for a killed PID namespace to empty (it takes milliseconds)

# Runs in the child before the cell: limits, then the audit hook, then the cell.
_BOOTSTRAP = r"""
import os, resource, signal, sys, traceback
import subprocess, _posixsubprocess
cpu, mem, fsize, nofile, nproc, code_fd = map(int, sys.argv[1:7])
root = os.path.realpath(os.getcwd())
with os.fdopen(code_fd, "rb") as fh:  # the parent checked that it is UTF-8
    code = fh.read().decode("utf-8")
limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
          (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (nofile, nofile)),
          (resource.RLIMIT_CORE, (0, 0))]
if nproc:  # counts every task of the uid: only meaningful under the jail's own uid
    limits.append((resource.RLIMIT_NPROC, (nproc, nproc)))
for kind, value in limits:
    resource.setrlimit(kind, value)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sys.dont_write_bytecode = True
BLOCKED = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec",
    "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "resource.setrlimit",
    "resource.prlimit", "socket.__new__", "socket.connect", "socket.bind",
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto",
    "ctypes.call_function", "ctypes.dlsym", "ctypes.cdata", "sys.remote_exec",
})
PATH_EVENTS = frozenset({
    "os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.truncate", "os.chmod", "os.chown",
    "os.utime", "os.link", "os.symlink", "os.chflags", "os.lchflags", "os.mkfifo",
    "os.mknod", "shutil.rmtree", "shutil.copyfile", "shutil.move", "shutil.copytree",
})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

def inside(path):
    if isinstance(path, int):
        return True
    real = realpath(fsdecode(path))
    return real == root or real.startswith(root + sep)

def hook(event, args):
    if event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writes and not inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory: {path!r}")
    elif event in PATH_EVENTS:
        for arg in args:
            if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                raise PermissionError(f"sandbox: {event} outside the working directory: {arg!r}")

def no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: _posixsubprocess.fork_exec is not allowed")

_posixsubprocess.fork_exec = no_fork_exec
sys.addaudithook(hook)
del limits, kind, value, fh, subprocess, _posixsubprocess
try:
    exec(compile(code, "<cell>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as err:
    traceback.print_exception(type(err), err, err.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass
class SandboxLimits:
    """Per-call resource limits."""

    cpu_s: int = 5
    """RLIMIT_CPU per process."""
    wall_s: float = 8.0
    """Below the agent loop's default tool timeout (10 s), so the sandbox's own report wins."""
    memory_mb: int = 1024
    """RLIMIT_AS per process (a call may hold up to max_processes times this)."""
    output_bytes: int = 8192
    """stdout + stderr kept; past it the call is stopped."""
    file_mb: int = 16
    """RLIMIT_FSIZE: the largest file the code may write."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_processes: int = 32
    """RLIMIT_NPROC of the call's uid, processes and threads together (bwrap only)."""
    disk_mb: int = 64
    """Size of the private /tmp tmpfs, the working directory (bwrap only; RAM-backed)."""

    def validate(self) -> None:
        for name, value in self.__dict__.items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")


@dataclass
class SandboxResult:
    """What one call produced."""

    output: str
    """stdout and stderr interleaved, at most `output_bytes` bytes."""
    exit_code: Optional[int]
    """The code's exit status; negative: killed by that signal; None: it did not run."""
    status: str
    """ok | error | timeout | cpu_limit | output_limit | killed | failed_to_start"""
    truncated: bool
    wall_s: float

    def observation(self) -> str:
        """The result as tool-observation text for the model."""
        text = self.output
        if self.truncated:
            text += "\n[output truncated]"
        notes = {
            "timeout": "Execution timed out (wall-time limit) and was stopped.",
            "cpu_limit": "Execution exceeded the CPU-time limit and was stopped.",
            "output_limit": "Output exceeded the limit; execution was stopped.",
            "killed": f"Execution was killed by signal {-(self.exit_code or 0)}.",
            "failed_to_start": "The interpreter could not be started.",
        }
        if self.status in notes:
            text = (text + "\n" if text else "") + notes[self.status]
        return text if text.strip() else "(no output)"


_PROBED_OK: set[tuple[str, int, int, int]] = set()
_PROBE_LOCK = threading.Lock()


class Sandbox:
    """Runs Python cells in contained subprocesses, at most `max_workers` at once.

    `isolation`: "bwrap" (kernel-enforced; raises RuntimeError here when the
    machine cannot provide it) or "weak" (rlimits + audit hook only; an explicit
    opt-in, logged as a warning). `uid_base`: the first of the uids bwrap calls
    lease (`sandbox_jail.UID_COUNT` of them; no host process may use them).
    """

    def __init__(
        self,
        limits: Optional[SandboxLimits] = None,
        max_workers: int = 4,
        isolation: str = "bwrap",
        python: str = sys.executable,
        uid_base: int = DEFAULT_UID_BASE,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, not {isolation!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.limits = limits or SandboxLimits()
        self.limits.validate()
        self.max_workers = max_workers
        self.isolation = isolation
        self.python = python
        self._slots = threading.BoundedSemaphore(max_workers)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._uids: Optional[UidPool] = None
        if isolation == "weak":
            logger.warning(WEAK_WARNING)
            return
        problem = jail_problem()
        if problem is None:
            self._uids = UidPool(uid_base)
            problem = self._probe()
        if problem is not None:
            raise RuntimeError(
                f"Sandbox isolation='bwrap' is not available on this machine: {problem}. Install bubblewrap "
                "(apt-get install -y bubblewrap) and run as root, or opt into isolation='weak' (rlimits and an "
                "audit hook only: not a boundary against code that attacks it)."
            )

    def _probe(self) -> Optional[str]:
        """Run one call through the jail; why it failed, or None. A success is remembered per process and
        configuration; a failure is not (it may have been a passing overload)."""
        key = (self.python, self._uids.base, self.limits.memory_mb, self.limits.max_processes)
        with _PROBE_LOCK:
            if key in _PROBED_OK:
                return None
            # The code's own limits, but time enough for a first start on a busy machine.
            limits = SandboxLimits(**{**self.limits.__dict__, "cpu_s": 60, "wall_s": 60.0})
            res = self._run_encoded(b"import os\nprint(os.getuid(), os.getpid())", limits)
            words = res.output.split()
            if res.status == "ok" and len(words) == 2 and int(words[0]) >= self._uids.base:
                _PROBED_OK.add(key)
                return None
            return f"a probe call came back {res.status!r} with output {res.output.strip()[-400:]!r}"

    def run(self, code: str) -> SandboxResult:
        """Execute `code` in a fresh contained interpreter; never raises for what the code is or does."""
        try:
            data = code.encode("utf-8")
        except UnicodeEncodeError as err:  # lone surrogates, e.g. from a JSON "\ud800" escape
            return SandboxResult(
                f"sandbox: the code is not valid Unicode text ({err.reason}: {code[err.start : err.end]!r} at "
                f"character {err.start}); it was not run.",
                None,
                "error",
                False,
                0.0,
            )
        with self._slots:
            return self._run_encoded(data)

    def run_many(self, codes: Sequence[str]) -> list[SandboxResult]:
        """Run many cells concurrently (bounded by `max_workers`), results in input order."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")
        return list(self._pool.map(self.run, codes))

    def close(self) -> None:
        """Stop the worker pool (running calls finish first)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # --- one call -------------------------------------------------------------
    def _command(self, lim: SandboxLimits, nproc: int, code_fd: int) -> list[str]:
        return [
            self.python,
            "-I",
            "-c",
            _BOOTSTRAP,
            str(lim.cpu_s),
            str(lim.memory_mb << 20),
            str(lim.file_mb << 20),
            str(lim.max_open_files),
            str(nproc),
            str(code_fd),
        ]

    def _run_encoded(self, data: bytes, limits: Optional[SandboxLimits] = None) -> SandboxResult:
        code_fd = _memfd("cell", data)
        try:
            if self._uids is None:
                return self._run_weak(code_fd, limits or self.limits)
            return self._run_jailed(code_fd, limits or self.limits)
        finally:
            os.close(code_fd)

    def _run_weak(self, code_fd: int, lim: SandboxLimits) -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="trace_sandbox_")
        try:
            env = {**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}
            return _supervise(self._command(lim, 0, code_fd), lim, cwd=workdir, env=env, pass_fds=(code_fd,))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run_jailed(self, code_fd: int, lim: SandboxLimits) -> SandboxResult:
        lease = self._uids.acquire()
        seccomp_fd = _memfd("seccomp", seccomp_program())
        info_r, info_w = os.pipe()
        try:
            env = {**_SANDBOX_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}
            argv = jail_argv(
                self.python,
                lease.uid,
                lim.disk_mb << 20,
                env,
                seccomp_fd,
                info_w,
                self._command(lim, lim.max_processes, code_fd),
            )
            return _supervise(
                argv,
                lim,
                cwd="/",
                env={"PATH": _SANDBOX_ENV["PATH"]},
                pass_fds=(code_fd, seccomp_fd, info_w),
                info=(info_r, info_w),
                uid=lease.uid,
            )
        finally:
            for fd in (seccomp_fd, info_r):
                os.close(fd)
            lease.release()  # only now: every process of the uid has exited


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start (handed to the child by number)."""
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _supervise(
    argv: list[str],
    lim: SandboxLimits,
    *,
    cwd: str,
    env: dict[str, str],
    pass_fds: tuple[int, ...],
    info: Optional[tuple[int, int]] = None,
    uid: Optional[int] = None,
) -> SandboxResult:
    """Start `argv`, collect its output under the limits, and stop everything it started.

    `info`: bwrap's --info-fd pipe (read end, write end); it reports the host pid
    of the PID namespace's init, which the parent kills and waits for.
    """
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except OSError as err:
        return SandboxResult(str(err), None, "failed_to_start", False, 0.0)
    finally:
        if info is not None:
            os.close(info[1])
    chunks: list[bytes] = []
    size, reason = 0, None
    deadline = start + lim.wall_s
    info_buf, jail = b"", None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        if info is not None:
            sel.register(info[0], selectors.EVENT_READ, "info")
        done = False
        while not done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = "timeout"
                break
            for key, _ in sel.select(timeout=remaining):
                data = os.read(key.fd, 65536)
                if key.data == "info":
                    info_buf += data
                    if not data:  # bwrap wrote the jail's pid (or failed before) and closed the pipe
                        sel.unregister(key.fd)
                        jail = _open_jail(info_buf, proc.pid)
                    continue
                if not data:
                    done = True
                    break
                chunks.append(data)
                size += len(data)
                if size > lim.output_bytes:
                    reason, done = "output_limit", True
                    break
    if reason is None:
        reason = _await_exit(proc.pid, deadline)
    if info is not None and jail is None and info_buf:
        jail = _open_jail(info_buf, proc.pid)
    _stop(proc, jail, uid)
    raw = b"".join(chunks)
    truncated = len(raw) > lim.output_bytes
    output = raw[: lim.output_bytes].decode("utf-8", errors="replace")
    code = proc.returncode
    if info is not None and code > 128:  # bwrap reports a signal death of the code as 128 + signal
        code = 128 - code
    if reason is None:
        if info is not None and not info_buf:
            reason = "failed_to_start"  # bwrap itself failed; its message is the output
        elif code == 0:
            reason = "ok"
        elif code == -signal.SIGXCPU:
            reason = "cpu_limit"
        elif code < 0:
            reason = "killed"
        else:
            reason = "error"
    return SandboxResult(output, code, reason, truncated, time.monotonic() - start)


def _open_jail(info: bytes, monitor_pid: int) -> Optional[int]:
    """A pidfd of the PID namespace's init named in bwrap's info, if it is still bwrap's child."""
    try:
        pid = int(json.loads(info)["child-pid"])
        fd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    try:
        # The pid is the jail's only while bwrap (our unreaped child) has not reaped it.
        with open(f"/proc/{pid}/stat") as fh:
            ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = -1
    if ppid != monitor_pid:
        os.close(fd)
        return None
    return fd


def _await_exit(pid: int, deadline: float) -> Optional[str]:
    """Wait, without reaping, until `pid` exits (None) or the deadline passes ("timeout")."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        os.close(fd)
    return None if ready else "timeout"


def _stop(proc: subprocess.Popen, jail: Optional[int], uid: Optional[int]) -> None:
    """Kill what is left of the call and wait until it is gone.

    bwrap: killing the PID namespace's init kills every process in it; its pidfd
    turns readable only after they have all exited. Weak: the process group.
    The leader is at most a zombie here (not reaped), so its group id cannot
    have been reused.
    """
    if jail is not None:
        try:
            signal.pidfd_send_signal(jail, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    proc.stdout.close()
    if jail is not None:
        select.select([jail], [], [], _TEARDOWN_S)
        os.close(jail)
    elif uid is not None:
        _await_uid_gone(uid, time.monotonic() + _TEARDOWN_S)


def _await_uid_gone(uid: int, deadline: float) -> None:
    """Wait until no process runs as `uid` (used only when bwrap died before naming its init)."""
    needle = f"\nUid:\t{uid}\t"
    while time.monotonic() < deadline:
        alive = False
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/status") as fh:
                        alive = needle in fh.read()
                except OSError:
                    continue
                if alive:
                    break
        if not alive:
            return
        time.sleep(0.01)
    logger.error("sandbox: processes of uid %d still alive %.0f s after the kill", uid, _TEARDOWN_S)


ATTACKS = {
    "infinite loop": "while True:\n    pass",
    "sleep past the wall limit": "import time\ntime.sleep(3600)",
    "fork bomb (os.fork)": "import os\nwhile True:\n    os.fork()",
    "fork bomb (shell)": "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    "memory bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))",
    "write outside the directory": "open('/usr/lib/trace_sandbox_escape.txt', 'w').write('x')",
    "open a socket": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
    "100 MB of output": "import sys\nsys.stdout.write('x' * 100_000_000)",
}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m trace_mega.envs.sandbox [--isolation bwrap|weak]`: run `ATTACKS` (all at
    once, beside a plain call) and print what each produced."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--isolation", default="bwrap", choices=ISOLATIONS)
    args = parser.parse_args(argv)
    box = Sandbox(isolation=args.isolation, max_workers=len(ATTACKS) + 1)
    attacks = {k: v for k, v in ATTACKS.items() if args.isolation == "bwrap" or "bomb" not in k}  # bombs: jail only
    names = [*attacks, "plain call (concurrent)"]
    codes = [*attacks.values(), "print(sum(range(10 ** 6)))"]
    start = time.monotonic()
    results = box.run_many(codes)
    print(
        f"isolation: {box.isolation}; "
        f"limits: {box.limits}; all {len(codes)} calls together: {time.monotonic() - start:.1f} s"
    )
    print("| attack | status | exit | wall s | last line of the observation |\n|---|---|---|---|---|")
    for name, res in zip(names, results):
        last = res.observation().strip().splitlines()[-1][:90].replace("|", "\\|")
        print(f"| {name} | {res.status} | {res.exit_code} | {res.wall_s:.2f} | {last} |")
    box.close()


if __name__ == "__main__":
    main()
