"""The Python sandbox in both isolation modes: limits, the hook's first error, concurrency.

Attacks written to defeat the hook are in test_sandbox_attacks.py (jail only).
"""

import logging
import os
import pathlib
import signal
import socket
import tempfile
import time
import uuid

import pytest
from jail import require_jail

from trace_mega.envs.sandbox import WEAK_WARNING, Sandbox, SandboxLimits

# A generous wall limit so that a busy CI machine cannot turn plain calls into timeouts;
# the wall-time tests use their own short limit.
LIMITS = SandboxLimits(cpu_s=1, wall_s=20.0, memory_mb=512, output_bytes=4096, file_mb=1)


@pytest.fixture(scope="module", params=["weak", "bwrap"])
def sandbox(request):
    if request.param == "bwrap":
        require_jail()
    box = Sandbox(limits=LIMITS, max_workers=4, isolation=request.param)
    yield box
    box.close()


def _no_children_left():
    """No child process of this one is left, running or a zombie, but multiprocessing's resource
    tracker: an earlier test that started processes with "spawn" keeps it for the whole session."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    children = set()
    for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():  # each thread's own children
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:  # the thread exited meanwhile
            continue
    return not children - {tracker}


def _like(sandbox, max_workers=1, **limits):
    """A sandbox with the same isolation as `sandbox` and other limits."""
    return Sandbox(
        limits=SandboxLimits(**{**LIMITS.__dict__, **limits}), max_workers=max_workers, isolation=sandbox.isolation
    )


def test_plain_code_runs(sandbox):
    res = sandbox.run("import math\nprint(math.comb(20, 10))")
    assert (res.status, res.exit_code, res.output.strip()) == ("ok", 0, "184756")
    err = sandbox.run("1/0")
    assert err.status == "error" and "ZeroDivisionError" in err.observation()
    assert 'File "<cell>", line 1' in err.output and 'File "<string>"' not in err.output


def test_working_directory_is_a_private_temporary_directory(sandbox):
    res = sandbox.run(
        "import os\nopen('scratch.txt', 'w').write('hi')\n"
        "print(os.getcwd()); print(os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR'])\n"
        "print(sorted(os.environ))"
    )
    cwd, same, env = res.output.splitlines()
    assert res.status == "ok" and same == "True"
    assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env
    if sandbox.isolation == "weak":  # a new host directory, removed afterwards
        assert cwd.startswith(tempfile.gettempdir()) and not os.path.exists(cwd)
    else:  # the jail's private /tmp: nothing of it reaches the host
        assert cwd == "/tmp" and not os.path.exists("/tmp/scratch.txt")


def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox):
    res = sandbox.run("while True:\n    pass")
    assert res.status == "cpu_limit" and "CPU-time limit" in res.observation()
    assert res.exit_code == -signal.SIGXCPU and res.wall_s < LIMITS.wall_s


def test_sleeping_code_is_killed_at_the_wall_time_limit(sandbox):
    short = _like(sandbox, wall_s=2.0)
    res = short.run("import time\ntime.sleep(60)")
    assert res.status == "timeout" and "timed out" in res.observation()
    assert 2.0 <= res.wall_s < 4.0
    # closing its output does not let a cell outlive the deadline
    res = short.run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)")
    assert res.status == "timeout" and res.wall_s < 4.0 and _no_children_left()


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.fork()",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('sleep 100 &')",
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
        "import multiprocessing as mp\nmp.Process(target=print).start()",
    ],
)
def test_the_hook_refuses_new_processes_first(sandbox, code):
    res = sandbox.run(code)
    assert res.status == "error" and "sandbox:" in res.output and "not allowed" in res.output
    assert _no_children_left()


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    ],
)
def test_fork_bomb_is_refused(sandbox, code):
    if sandbox.isolation != "bwrap":
        pytest.skip("fork bombs run only under the kernel jail")
    res = sandbox.run(code)
    assert res.status == "error" and "sandbox:" in res.output and "not allowed" in res.output
    assert _no_children_left()


def test_memory_bomb_fails_with_memory_error(sandbox):
    res = sandbox.run("x = bytearray(4 * 1024 ** 3)")
    assert res.status == "error" and "MemoryError" in res.output
    res = _like(sandbox, cpu_s=20).run("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))")
    assert res.status == "error" and "MemoryError" in res.output


def test_writes_outside_the_directory_are_refused(sandbox, tmp_path):
    """The hook's message comes first in both modes. The outside place is one the code can see: a host
    directory for the weak mode, the (read-only) stdlib directory in the jail, whose /tmp is private."""
    if sandbox.isolation == "bwrap":
        tmp_path = pathlib.Path(os.path.dirname(os.__file__))
    target = tmp_path / f"escape-{uuid.uuid4().hex}.txt"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
        f"import shutil\nopen('a', 'w').write('x')\nshutil.copyfile('a', {str(target)!r})",
        f"import os\nos.remove({str(tmp_path)!r})",
        "import pathlib\npathlib.Path('../elsewhere.txt').write_text('x')",
    ]
    for code in attempts:
        res = sandbox.run(code)
        assert res.status == "error" and "sandbox:" in res.output, (code, res.output)
    assert not target.exists() and tmp_path.exists()


def test_file_size_is_capped(sandbox):
    res = sandbox.run("open('big', 'wb').write(b'x' * (4 * 1024 ** 2))")
    assert res.status == "error" and "File too large" in res.output


def test_sockets_are_refused(sandbox):
    with socket.socket() as server:  # a listener the child would reach without the sandbox
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        res = sandbox.run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))")
        assert res.status == "error" and "sandbox: socket" in res.output
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    res = sandbox.run("import urllib.request\nurllib.request.urlopen('http://example.com')")
    assert res.status == "error" and "sandbox: socket" in res.output


def test_100mb_of_output_is_truncated_and_stopped(sandbox):
    start = time.monotonic()
    res = sandbox.run("import sys\nsys.stdout.write('x' * 100_000_000)\nprint('end')")
    assert res.status == "output_limit" and res.truncated
    assert len(res.output) == LIMITS.output_bytes and "[output truncated]" in res.observation()
    assert time.monotonic() - start < LIMITS.wall_s


@pytest.mark.slow
def test_a_bomb_does_not_disturb_concurrent_calls(sandbox):
    fork = "import os\nwhile True:\n    os.fork()" if sandbox.isolation == "bwrap" else "import os\nos.fork()"
    bombs = [
        "while True:\n    pass",
        "x = bytearray(4 * 1024 ** 3)",
        "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)",
        fork,
        "import time\ntime.sleep(60)",
    ]
    normal = [f"import time\ntime.sleep(0.3)\nprint(sum(range({n})))" for n in range(10)]
    codes = [c for pair in zip(bombs * 2, normal) for c in pair]
    fds = len(os.listdir("/proc/self/fd"))
    box = _like(sandbox, max_workers=4, wall_s=8.0)
    results = box.run_many(codes)
    box.close()
    for code, res in zip(codes, results):
        if code in normal:
            n = normal.index(code)
            assert (res.status, res.output.strip()) == ("ok", str(sum(range(n))))
        else:
            assert res.status != "ok"
    assert len(os.listdir("/proc/self/fd")) <= fds + 1  # the pool's own pipes aside
    assert _no_children_left()


def test_sixty_four_jailed_calls_at_once_each_under_its_own_uid():
    """The agent loop runs every live episode's tool call at once: the uid pool and the per-uid
    process limit must not be what bounds it. Each call holds its uid lease from before its
    interpreter starts until after it exits, so 64 calls sleeping together hold 64 uids."""
    require_jail()
    box = Sandbox(limits=SandboxLimits(**{**LIMITS.__dict__, "wall_s": 120.0}), max_workers=64)
    results = box.run_many(["import os, time\ntime.sleep(5)\nprint(os.getuid())"] * 64)
    box.close()
    assert [r.status for r in results] == ["ok"] * 64
    uids = {int(r.output) for r in results}
    assert len(uids) == 64 and min(uids) >= 61000
    assert _no_children_left()


def test_bad_isolation_name_and_limits():
    with pytest.raises(ValueError, match="bwrap, weak"):
        Sandbox(isolation="chroot")
    with pytest.raises(ValueError, match="max_processes"):
        Sandbox(limits=SandboxLimits(max_processes=0), isolation="weak")


def test_weak_mode_warns_every_time(caplog):
    with caplog.at_level(logging.WARNING, logger="trace_mega.envs.sandbox"):
        for _ in range(2):
            Sandbox(isolation="weak").close()
    assert [r.getMessage() for r in caplog.records].count(WEAK_WARNING) == 2


def test_missing_jail_fails_at_construction_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without bubblewrap
    with pytest.raises(RuntimeError, match=r"bwrap.*not installed.*apt-get install -y bubblewrap.*isolation='weak'"):
        Sandbox()


def test_lone_surrogates_become_an_error_observation(sandbox):
    res = sandbox.run("print('\ud800 and \udfff')")
    assert (res.status, res.exit_code) == ("error", None)
    assert "not valid Unicode text" in res.observation() and "it was not run" in res.observation()


def test_the_jail_runs_an_interpreter_that_lives_under_tmp():
    """A venv under /tmp (a checkout or venv there, as on many clusters' scratch space) is bound on
    top of the jail's private /tmp instead of being hidden by it; the code still cannot write to it."""
    require_jail()
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="trace_jail_venv_") as root:
        venv = pathlib.Path(root) / "venv"
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
        box = Sandbox(limits=LIMITS, max_workers=1, python=str(venv / "bin" / "python"))
        try:
            res = box.run("import os, sys\nprint(sys.prefix)\nprint(os.getcwd())")
            assert res.status == "ok", res.output
            assert res.output.split() == [str(venv), "/tmp"]
            res = box.run(f"open({str(venv / 'planted.py')!r}, 'w')")
            assert res.status == "error" and "Read-only file system" in res.output
            assert not (venv / "planted.py").exists()
        finally:
            box.close()


def test_an_interpreter_holding_a_private_mount_is_refused_by_name(monkeypatch):
    from trace_mega.envs import sandbox_jail

    monkeypatch.setattr(sandbox_jail, "interpreter_paths", lambda python: ("/tmp",))
    with pytest.raises(RuntimeError, match=r"needs /tmp, which is or holds /tmp, a directory the jail mounts"):
        sandbox_jail._mount_args("/tmp/python", 1 << 20)
