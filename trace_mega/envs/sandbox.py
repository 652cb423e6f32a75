"""A contained Python interpreter for tool calls: one fresh subprocess per call.

Each call runs `python -I` (isolated mode: no user site, no PYTHON* variables,
no cwd on sys.path) in a new temporary directory, with an environment holding
only PATH, HOME/TMPDIR (= the sandbox directory) and single-thread BLAS
settings. What guarantees what:

* CPU time: RLIMIT_CPU (soft limit -> SIGXCPU, hard limit one second later -> SIGKILL).
* Wall time: the parent kills the child's whole process group (the child is a
  session leader) at the deadline, whatever the child does.
* Memory: RLIMIT_AS; allocations beyond it fail with MemoryError in the child.
* Output: stdout and stderr share one pipe that the parent reads with a cap;
  past the cap the process group is killed and the output marked truncated.
* Files: RLIMIT_FSIZE caps any file the child writes (SIGXFSZ is ignored so the
  write fails with an OSError instead); RLIMIT_NOFILE caps open descriptors;
  an audit hook (`sys.addaudithook`, installed before the cell runs and not
  removable from Python) refuses to open for writing, create, remove, rename,
  chmod or link any path whose real path is outside the sandbox directory.
* Processes: the audit hook refuses fork, exec, spawn, system, subprocess,
  kill and setrlimit, `_posixsubprocess.fork_exec` (not audited by CPython) is
  replaced before the cell runs, and ctypes foreign calls are refused. Any
  descendant that still appeared would share the process group (killed at the
  deadline) and inherit the CPU/memory limits. RLIMIT_NPROC is not used: the
  kernel counts every process of the user and exempts root (measured: it does
  not stop forks of a root trainer even inside a user namespace).
* Network: the audit hook refuses socket creation, connect, bind, sendto and
  name lookups. Where `unshare --user --map-root-user --net` works (probed
  once), the child also runs in a fresh network namespace with no interfaces
  up, which the kernel enforces whatever the code does.

The audit hook contains accidents and naive attempts of model-written code; it
is not a boundary against deliberately adversarial code (CPython offers none
in-process). The kernel-enforced limits and the process-group kill hold either way.
"""
from __future__ import annotations

import os
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
from functools import lru_cache
from typing import Optional, Sequence

# Runs in the child before the cell: limits, then the audit hook, then the cell.
_BOOTSTRAP = r"""
import os, resource, signal, sys, traceback
import subprocess, _posixsubprocess
cpu, mem, fsize, nofile = map(int, sys.argv[1:5])
root = os.path.realpath(os.getcwd())
with open(os.path.join(root, ".cell.py"), encoding="utf-8") as fh:
    code = fh.read()
limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
          (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (nofile, nofile)),
          (resource.RLIMIT_CORE, (0, 0))]
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
    wall_s: float = 8.0
    """Below the agent loop's default tool timeout (10 s), so the sandbox's own report wins."""
    memory_mb: int = 1024
    output_bytes: int = 8192
    file_mb: int = 16
    max_open_files: int = 64


@dataclass
class SandboxResult:
    """What one call produced."""

    output: str
    """stdout and stderr interleaved, at most `output_bytes` bytes."""
    exit_code: Optional[int]
    """The child's exit status; negative: killed by that signal."""
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


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare --user --map-root-user --net` can run here."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--net", "true"],
            capture_output=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


class Sandbox:
    """Runs Python cells in contained subprocesses, at most `max_workers` at once.

    `isolation`: "auto" uses user + network namespaces when available, "namespaces"
    requires them, "none" relies on rlimits and the audit hook only.
    """

    def __init__(
        self,
        limits: Optional[SandboxLimits] = None,
        max_workers: int = 4,
        isolation: str = "auto",
        python: str = sys.executable,
    ) -> None:
        if isolation not in ("auto", "namespaces", "none"):
            raise ValueError(f"isolation must be auto, namespaces or none, not {isolation!r}")
        if isolation == "namespaces" and not namespaces_available():
            raise RuntimeError("isolation='namespaces' but `unshare --user --net` is not usable here")
        self.limits = limits or SandboxLimits()
        self.max_workers = max_workers
        self.use_namespaces = isolation != "none" and namespaces_available()
        self.python = python
        self._slots = threading.BoundedSemaphore(max_workers)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()

    def _command(self) -> list[str]:
        lim = self.limits
        args = [str(lim.cpu_s), str(lim.memory_mb << 20), str(lim.file_mb << 20),
                str(lim.max_open_files)]
        cmd = [self.python, "-I", "-c", _BOOTSTRAP, *args]
        if self.use_namespaces:
            cmd = ["unshare", "--user", "--map-root-user", "--net", "--", *cmd]
        return cmd

    def run(self, code: str) -> SandboxResult:
        """Execute `code` in a fresh contained interpreter; never raises for what the code does."""
        with self._slots:
            workdir = tempfile.mkdtemp(prefix="trace_sandbox_")
            try:
                with open(os.path.join(workdir, ".cell.py"), "w", encoding="utf-8") as fh:
                    fh.write(code)
                return self._supervise(workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

    def run_many(self, codes: Sequence[str]) -> list[SandboxResult]:
        """Run many cells concurrently (bounded by `max_workers`), results in input order."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")
        return list(self._pool.map(self.run, codes))

    def _supervise(self, workdir: str) -> SandboxResult:
        lim = self.limits
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                self._command(), cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )
        except OSError as err:
            return SandboxResult(str(err), None, "failed_to_start", False, 0.0)
        chunks: list[bytes] = []
        size, reason = 0, None
        deadline = start + lim.wall_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    reason = "timeout"
                    break
                if not sel.select(timeout=remaining):
                    continue
                data = os.read(proc.stdout.fileno(), 65536)
                if not data:
                    break
                chunks.append(data)
                size += len(data)
                if size > lim.output_bytes:
                    reason = "output_limit"
                    break
        if reason is None:
            reason = _await_exit(proc.pid, deadline)
        # The leader is at most a zombie here (not reaped), so its group id cannot have been
        # reused: kill whatever is left in the group, then reap.
        _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        raw = b"".join(chunks)
        truncated = len(raw) > lim.output_bytes
        output = raw[: lim.output_bytes].decode("utf-8", errors="replace")
        code = proc.returncode
        if reason is None:
            if code == 0:
                reason = "ok"
            elif code == -signal.SIGXCPU:
                reason = "cpu_limit"
            elif code < 0:
                reason = "killed"
            else:
                reason = "error"
        return SandboxResult(output, code, reason, truncated, time.monotonic() - start)

    def close(self) -> None:
        """Stop the worker pool (running calls finish first)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _await_exit(pid: int, deadline: float) -> Optional[str]:
    """Wait, without reaping, until `pid` exits (None) or the deadline passes ("timeout")."""
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return "timeout"
        time.sleep(0.005)
    return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass



ATTACKS = {
    "infinite loop": "while True:\n    pass",
    "sleep past the wall limit": "import time\ntime.sleep(3600)",
    "fork bomb (os.fork)": "import os\nwhile True:\n    os.fork()",
    "fork bomb (shell)": "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    "memory bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))",
    "write outside the directory": "open('/tmp/trace_sandbox_escape.txt', 'w').write('x')",
    "open a socket": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
    "100 MB of output": "import sys\nsys.stdout.write('x' * 100_000_000)",
}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m trace_mega.envs.sandbox [--isolation auto|none]`: run `ATTACKS` (all at
    once, beside a plain call) and print what each produced."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "none"])
    args = parser.parse_args(argv)
    box = Sandbox(isolation=args.isolation, max_workers=len(ATTACKS) + 1)
    names = [*ATTACKS, "plain call (concurrent)"]
    codes = [*ATTACKS.values(), "print(sum(range(10 ** 6)))"]
    start = time.monotonic()
    results = box.run_many(codes)
    print(f"isolation: {'namespaces' if box.use_namespaces else 'rlimits + audit hook'}; "
          f"limits: {box.limits}; all {len(codes)} calls together: {time.monotonic() - start:.1f} s")
    print("| attack | status | exit | wall s | last line of the observation |\n|---|---|---|---|---|")
    for name, res in zip(names, results):
        last = res.observation().strip().splitlines()[-1][:90].replace("|", "\\|")
        print(f"| {name} | {res.status} | {res.exit_code} | {res.wall_s:.2f} | {last} |")
    box.close()


if __name__ == "__main__":
    main()
