"""Attacks on the kernel jail (`Sandbox(isolation="bwrap")`), written as an adversary would.

Most attacks first switch the audit hook off (three ways: the bootstrap's
globals, builtins, the hook's code object found through `gc`), then try what
the hook would have refused. Every attack runs concurrently with the others
and with plain calls, and for each the test checks that:

* it came back as an observation within its wall limit (plus teardown slack);
* the cell never printed ESCAPED (each attempt prints CONTAINED with the error
  the kernel gave, or ESCAPED when the forbidden operation succeeded);
* no process carrying the attack's marker (in argv or the environment, which
  children inherit) is alive on the host right after its call returned;
* no file appeared or changed outside the jail (canary paths on the host);
* the test process, a victim process and every concurrent plain call survived;
* loopback TCP / UDP / abstract-unix listeners of the test saw nothing;
* a secret in the test process's environment never reached any output.

Fork and thread bombs run only here, under the jail; without it the module
skips (CI: fails, see tests/envs/jail.py).
"""

import os
import site
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from jail import require_jail

from trace_mega.envs.sandbox import Sandbox, SandboxLimits

RUN = uuid.uuid4().hex[:12]
SECRET = f"trace-attack-secret-{RUN}"
CANARY = f"/tmp/trace_attack_canary_{RUN}"
SITE = site.getsitepackages()[0]
STDLIB = os.path.dirname(os.__file__)
# Plain attacks get a roomy wall limit (a loaded CI machine must not turn them into timeouts);
# the bombs a short one, which they always reach.
LIMITS = SandboxLimits(cpu_s=2, wall_s=15.0, memory_mb=256, output_bytes=4096, file_mb=1, max_processes=16, disk_mb=8)
BOMB_LIMITS = SandboxLimits(**{**LIMITS.__dict__, "wall_s": 3.0})
TEARDOWN_SLACK_S = 3.0

PRELUDE = """\
import os, sys
os.environ["TRACE_ATTACK_MARK"] = "@MARK@"
def attempt(what, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (OSError, ValueError) as err:
        print("CONTAINED", what, type(err).__name__, getattr(err, "errno", ""), flush=True)
    else:
        print("ESCAPED", what, flush=True)
"""
HOOK_OFF_GLOBALS = """\
_boot = sys.modules["__main__"]  # the bootstrap's module: the hook reads its settings from here
_boot.BLOCKED = frozenset(); _boot.PATH_EVENTS = frozenset(); _boot.inside = lambda path: True
"""
HOOK_OFF_BUILTINS = """\
import builtins
builtins.isinstance = lambda obj, types: True  # the hook's inside() now passes every path
builtins.any = lambda iterable: False
"""
HOOK_OFF_GC = """\
import gc
for _f in gc.get_objects():
    if type(_f).__name__ == "function" and _f.__name__ == "hook" and _f.__code__.co_filename == "<string>":
        _f.__code__ = (lambda event, args: None).__code__
"""
# Start `sleep` as a daemon (new session, marker in argv and env) through a raw fork_exec.
SPAWN_WITH = """\
def spawn(fork_exec):
    args = [b"sleep-@MARK@", b"100"]
    common = (args, [b"/usr/bin/sleep"], True, (), None, [b"TRACE_ATTACK_MARK=@MARK@"],
              -1, -1, -1, -1, -1, -1, *os.pipe(), False, True, -1, None, None, None, -1, None)
    try:
        pid = fork_exec(*common, False)  # 3.11 / 3.12 take allow_vfork last
    except TypeError:
        pid = fork_exec(*common)
    print("SPAWNED", pid, flush=True)
"""


@dataclass
class Attack:
    name: str
    code: str
    expect: tuple[str, ...] = ()
    """Substrings the output must contain (the cell's own report of what the kernel did)."""
    statuses: tuple[str, ...] = ("ok", "error")
    bomb: bool = False


def _cell(body: str) -> str:
    return PRELUDE + body


ATTACKS = [
    Attack(
        "hook off via bootstrap globals, then a .pth file into site-packages",
        HOOK_OFF_GLOBALS + f'attempt("pth", lambda: open({SITE!r} + "/evil-@MARK@.pth", "w").write("import os"))',
        ("CONTAINED pth OSError 30",),
    ),
    Attack(
        "hook off via builtins, then a file in /usr/lib",
        HOOK_OFF_BUILTINS + 'attempt("usr", os.open, "/usr/lib/evil-@MARK@", os.O_CREAT | os.O_WRONLY)',
        ("CONTAINED usr OSError 30",),
    ),
    Attack(
        "hook off via gc (its code swapped), then TCP to the test's loopback listener",
        HOOK_OFF_GC + 'import socket\nattempt("tcp", socket.create_connection, ("127.0.0.1", @PORT@), 2)',
        ("CONTAINED tcp ConnectionRefusedError",),
    ),
    Attack(
        "dir_fd: create a module in the stdlib directory (the hook sees only the relative name)",
        f"fd = os.open({STDLIB!r}, os.O_RDONLY)\n"
        'attempt("dirfd", os.open, "evil_@MARK@.py", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)\n'
        'attempt("mkdir", os.mkdir, "evil-@MARK@", dir_fd=fd)',
        ("CONTAINED dirfd OSError 30", "CONTAINED mkdir OSError 30"),
    ),
    Attack(
        "descriptor-based fchmod / fchown / ftruncate of the interpreter",
        "fd = os.open(sys.executable, os.O_RDONLY)\n"
        'attempt("fchmod", os.fchmod, fd, 0o777)\nattempt("fchown", os.fchown, fd, 0, 0)\n'
        'attempt("ftruncate", os.ftruncate, fd, 0)',
        ("CONTAINED fchmod OSError 30", "CONTAINED fchown OSError 30", "CONTAINED ftruncate OSError 22"),
    ),
    Attack(
        "symlink made by dir_fd inside the stdlib directory",
        f'fd = os.open({STDLIB!r}, os.O_RDONLY)\nattempt("symlink", os.symlink, "os.py", "evil-@MARK@", dir_fd=fd)',
        ("CONTAINED symlink OSError 30",),
    ),
    Attack(
        "symlink race: a thread flips a link between inside and /usr/lib while writes go through it",
        HOOK_OFF_GLOBALS
        + """\
import threading, time
open("inside.txt", "w").close()
stop = []
def flip():
    n = 0
    while not stop:
        try:
            os.remove("link")
        except OSError:
            pass
        os.symlink("/usr/lib/evil-@MARK@" if n % 2 else "inside.txt", "link")
        n += 1
t = threading.Thread(target=flip); t.start()
ok = refused = 0
end = time.monotonic() + 0.5
while time.monotonic() < end:
    try:
        os.close(os.open("link", os.O_CREAT | os.O_WRONLY | os.O_APPEND)); ok += 1
    except OSError:
        refused += 1
stop.append(1); t.join()
print("CONTAINED race" if not os.path.exists("/usr/lib/evil-@MARK@") else "ESCAPED race", ok, refused)
""",
        ("CONTAINED race",),
    ),
    Attack(
        "symlink to the host's canary path in /tmp, written through",
        f'os.symlink({CANARY!r}, "l")\nopen("l", "w").write("pwned")\nprint("wrote the private /tmp")',
        ("wrote the private /tmp",),
    ),
    Attack(
        "pidfd_send_signal(pidfd_open(getppid()), SIGKILL)",
        'import signal\nattempt("pidfd", lambda: signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL))',
        ("CONTAINED pidfd PermissionError 1",),
    ),
    Attack(
        "kill(-1, SIGKILL) with the hook off",
        HOOK_OFF_GLOBALS + 'import signal\nattempt("kill-1", os.kill, -1, signal.SIGKILL)',
        ("CONTAINED kill-1 ProcessLookupError",),
    ),
    Attack(
        "kill the test process and a victim by host pid",
        HOOK_OFF_GLOBALS + 'import signal\nattempt("kill-host", os.kill, @HOSTPID@, signal.SIGKILL)\n'
        'attempt("kill-victim", os.kill, @VICTIM@, signal.SIGKILL)\n'
        'attempt("pidfd-victim", os.pidfd_open, @VICTIM@)',
        (
            "CONTAINED kill-host ProcessLookupError",
            "CONTAINED kill-victim ProcessLookupError",
            "CONTAINED pidfd-victim ProcessLookupError",
        ),
    ),
    Attack(
        "private subprocess._fork_exec binding starts a setsid daemon",
        SPAWN_WITH + "import subprocess\nspawn(subprocess._fork_exec)",
        ("SPAWNED",),
    ),
    Attack(
        "re-imported _posixsubprocess starts a setsid daemon",
        SPAWN_WITH
        + """\
import importlib.util
sys.modules.pop("_posixsubprocess", None)
spec = importlib.util.find_spec("_posixsubprocess")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
spawn(mod.fork_exec)
""",
        ("SPAWNED",),
    ),
    Attack(
        "setsid orphan (hook off, double fork), parent returns at once",
        HOOK_OFF_GLOBALS
        + """\
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/sleep", ["sleep-@MARK@", "100"])
    os._exit(0)
print("parent done")
""",
        ("parent done",),
    ),
    Attack(
        "daemon that closes its output so the pipe cannot hold the call",
        HOOK_OFF_GLOBALS
        + """\
if os.fork() == 0:
    os.setsid()
    os.closerange(0, 3)
    os.execv("/usr/bin/sleep", ["sleep-@MARK@", "100"])
print("parent done")
""",
        ("parent done",),
    ),
    Attack(
        "raw sockets (hook off)",
        HOOK_OFF_GLOBALS + "import socket\n"
        'attempt("raw", socket.socket, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\n'
        'attempt("packet", socket.socket, socket.AF_PACKET, socket.SOCK_RAW, 0)',
        ("CONTAINED raw PermissionError 1", "CONTAINED packet PermissionError 1"),
    ),
    Attack(
        "UDP to the test's port and to the internet (hook off)",
        HOOK_OFF_GLOBALS + "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        's.sendto(b"x", ("127.0.0.1", @UDPPORT@))\nprint("sent into the jail\'s own loopback")\n'
        'attempt("udp-out", s.sendto, b"x", ("8.8.8.8", 53))',
        ("CONTAINED udp-out OSError 101",),
    ),
    Attack(
        "DNS lookup and TCP to the internet and to IPv6 loopback (hook off)",
        HOOK_OFF_GLOBALS + 'import socket\nattempt("dns", socket.getaddrinfo, "example.com", 80)\n'
        'attempt("tcp-out", socket.create_connection, ("1.1.1.1", 80), 2)\n'
        'attempt("tcp6", socket.create_connection, ("::1", @PORT@), 2)',
        ("CONTAINED dns gaierror", "CONTAINED tcp-out OSError 101", "CONTAINED tcp6"),
    ),
    Attack(
        "abstract unix socket of the test process (hook off)",
        HOOK_OFF_GLOBALS + "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        'attempt("unix", s.connect, "\\0trace-attack-@MARK0@")',
        ("CONTAINED unix ConnectionRefusedError",),
    ),
    Attack(
        "the parent's environment through /proc, and every environ readable",
        'attempt("ppid-environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())\n'
        'for pid in [p for p in os.listdir("/proc") if p.isdigit()]:\n'
        '    for part in ("environ", "cmdline"):\n'
        "        try:\n"
        '            data = open(f"/proc/{pid}/{part}", "rb").read()\n'
        "        except OSError:\n"
        "            continue\n"
        '        if b"trace-attack-secret" in data:\n'
        '            print("ESCAPED secret", data)\n'
        'print("scanned", len(os.listdir("/proc")))',
        ("CONTAINED ppid-environ PermissionError 13",),
    ),
    Attack(
        "the test process's /proc entry by host pid",
        'attempt("host-environ", lambda: open("/proc/@HOSTPID@/environ", "rb").read())',
        ("CONTAINED host-environ FileNotFoundError",),
    ),
    Attack(
        "writes everywhere visible (hook off)",
        HOOK_OFF_GLOBALS
        + "".join(
            f'attempt({d!r}, lambda: open({d!r} + "/evil-@MARK@", "w"))\n'
            for d in ("/", "/etc", "/usr", "/proc", SITE, STDLIB, os.path.dirname(sys.executable))
        ),
        ("CONTAINED / PermissionError 13", "CONTAINED /usr OSError 30", f"CONTAINED {SITE} OSError 30"),
    ),
    Attack(
        "sysctl write and /dev/shm (hook off)",
        HOOK_OFF_GLOBALS + 'attempt("sysctl", lambda: open("/proc/sys/kernel/hostname", "w").write("x"))\n'
        'attempt("shm", lambda: open("/dev/shm/evil-@MARK@", "w"))',
        ("CONTAINED sysctl", "CONTAINED shm PermissionError 13"),
    ),
    Attack(
        "namespaces, mount, setuid and ptrace through ctypes / os (hook off)",
        HOOK_OFF_GLOBALS
        + """\
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for what, flags in (("userns", 0x10000000), ("mountns", 0x00020000), ("netns", 0x40000000)):
    rc = libc.unshare(flags)
    print(("ESCAPED" if rc == 0 else "CONTAINED"), what, os.strerror(ctypes.get_errno()), flush=True)
rc = libc.mount(b"none", b"/usr", b"tmpfs", 0, None)
print(("ESCAPED" if rc == 0 else "CONTAINED"), "mount", flush=True)
rc = libc.ptrace(16, 1, None, None)  # PTRACE_ATTACH to the jail's init
print(("ESCAPED" if rc == 0 else "CONTAINED"), "ptrace", flush=True)
attempt("setuid", os.setuid, 0)
attempt("setgid", os.setgid, 0)
""",
        (
            "CONTAINED userns Operation not permitted",
            "CONTAINED mount",
            "CONTAINED ptrace",
            "CONTAINED setuid PermissionError 1",
        ),
    ),
    Attack(
        "raise the hard limits (hook off)",
        HOOK_OFF_GLOBALS + "import resource\ninf = resource.RLIM_INFINITY\n"
        'attempt("nproc", resource.setrlimit, resource.RLIMIT_NPROC, (inf, inf))\n'
        'attempt("as", resource.setrlimit, resource.RLIMIT_AS, (inf, inf))',
        ("CONTAINED nproc ValueError", "CONTAINED as ValueError"),
    ),
    Attack(
        "disk fill with many files in the working directory",
        'n = 0\ntry:\n    while True:\n        open(f"fill{n}", "wb").write(b"x" * 500_000); n += 1\n'
        'except OSError as err:\n    print("CONTAINED fill", err.errno, n)',
        ("CONTAINED fill 28",),
    ),
    Attack(
        "disk fill with one huge file",
        'attempt("big", lambda: open("big", "wb").write(b"x" * (64 << 20)))',
        ("CONTAINED big OSError 27",),
    ),
    Attack(
        "output flood from eight processes (hook off)",
        HOOK_OFF_GLOBALS + "for _ in range(8):\n    if os.fork() == 0:\n        break\n"
        'while True:\n    os.write(1, b"y" * 65536)',
        statuses=("output_limit",),
    ),
    Attack(
        "SIGXCPU ignored in a busy loop",
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        statuses=("killed", "timeout"),
        bomb=True,
    ),
    Attack(
        "fork bomb (hook off)",
        HOOK_OFF_GLOBALS
        + """\
import time
forks = 0
while True:
    try:
        os.fork(); forks += 1
    except OSError as err:
        print("CONTAINED fork", err.errno, flush=True)
        time.sleep(60)
""",
        ("CONTAINED fork 11",),
        statuses=("timeout",),
        bomb=True,
    ),
    Attack(
        "shell fork bomb (hook off)",
        HOOK_OFF_GLOBALS + 'import subprocess, time\nsubprocess.Popen(["sh", "-c", ":(){ :|:& };:"])\ntime.sleep(60)',
        statuses=("timeout",),
        bomb=True,
    ),
    Attack(
        "thread bomb",
        "import threading, time\nthreads = []\ntry:\n    while True:\n"
        "        t = threading.Thread(target=time.sleep, args=(60,), daemon=True); t.start(); threads.append(t)\n"
        'except RuntimeError as err:\n    print("CONTAINED threads", len(threads), err, flush=True)\n'
        "time.sleep(60)",
        ("CONTAINED threads",),
        statuses=("timeout",),
        bomb=True,
    ),
    Attack(
        "sleep with closed output",
        "import time\nos.close(1)\nos.close(2)\ntime.sleep(60)",
        statuses=("timeout",),
        bomb=True,
    ),
]
PLAIN = [f"print(sum(range({n})))" for n in range(6)]


def _mark(i: int) -> str:
    """Attack i's marker (no marker is a prefix of another)."""
    return f"{RUN}x{i}x"


def _pids_with(marker: bytes) -> list[int]:
    """Host pids whose argv or environment carries `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as fh:
                    if marker in fh.read():
                        found.append(int(pid))
                        break
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def outcome():
    require_jail()
    os.environ["TRACE_ATTACK_SECRET"] = SECRET  # would reach the code if the environment leaked
    with open(CANARY, "w") as fh:
        fh.write("canary")
    canary_stat = os.stat(CANARY)
    tcp = socket.create_server(("127.0.0.1", 0))
    try:
        tcp6 = socket.create_server(("::1", tcp.getsockname()[1]), family=socket.AF_INET6)
    except OSError:  # no IPv6 on this host
        tcp6 = None
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0trace-attack-{RUN}")
    unix.listen(1)
    victim = subprocess.Popen(["sleep", "600"])
    box, bombs = Sandbox(limits=LIMITS, max_workers=4), Sandbox(limits=BOMB_LIMITS, max_workers=4)
    subs = {
        "@PORT@": str(tcp.getsockname()[1]),
        "@UDPPORT@": str(udp.getsockname()[1]),
        "@HOSTPID@": str(os.getpid()),
        "@VICTIM@": str(victim.pid),
        "@MARK0@": RUN,
    }

    def run(i, attack):
        mark = _mark(i)
        code = _cell(attack.code)
        for key, value in {**subs, "@MARK@": mark}.items():
            code = code.replace(key, value)
        res = (bombs if attack.bomb else box).run(code)
        return res, _pids_with(mark.encode())

    def plain(code):
        return box.run(code)

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:  # the two sandboxes admit 4 calls each
        futures = [pool.submit(run, i, a) for i, a in enumerate(ATTACKS)]
        plains = [pool.submit(plain, c) for c in PLAIN]
        results = {a.name: f.result() for a, f in zip(ATTACKS, futures)}
        plain_results = [f.result() for f in plains]
    wall = time.monotonic() - start
    print(f"\n{len(ATTACKS)} attacks + {len(PLAIN)} plain calls in {wall:.1f} s")
    for a in ATTACKS:
        res = results[a.name][0]
        print(f"  {res.status:13s} {res.wall_s:5.2f}s  {a.name}")
    leaks = []
    for sock in (tcp, tcp6, unix):
        if sock is None:
            continue
        sock.setblocking(False)
        try:
            sock.accept()
            leaks.append(f"a connection reached {sock.getsockname()!r}")
        except BlockingIOError:
            pass
    udp.setblocking(False)
    try:
        leaks.append(f"a datagram reached the UDP port: {udp.recv(100)!r}")
    except BlockingIOError:
        pass
    out = {
        "results": results,
        "plain": plain_results,
        "leaks": leaks,
        "victim_alive": victim.poll() is None,
        "canary_intact": open(CANARY).read() == "canary" and os.stat(CANARY).st_mtime_ns == canary_stat.st_mtime_ns,
    }
    yield out
    victim.kill()
    victim.wait()
    for sock in (tcp, tcp6, udp, unix):
        if sock is not None:
            sock.close()
    os.remove(CANARY)
    del os.environ["TRACE_ATTACK_SECRET"]
    box.close()
    bombs.close()


def test_suite_is_large_enough():
    assert len(ATTACKS) >= 25 and len({a.name for a in ATTACKS}) == len(ATTACKS)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_contained(outcome, attack):
    res, left = outcome["results"][attack.name]
    limits = BOMB_LIMITS if attack.bomb else LIMITS
    assert res.status in attack.statuses, (res.status, res.output)
    assert res.wall_s <= limits.wall_s + TEARDOWN_SLACK_S
    assert res.observation().strip()
    assert "ESCAPED" not in res.output and SECRET not in res.output, res.output
    for needle in attack.expect:
        assert needle in res.output, (needle, res.output)
    assert left == [], f"processes of the attack still alive after its call returned: {left}"


def test_nothing_outside_the_jail_was_touched(outcome):
    assert outcome["leaks"] == []
    assert outcome["victim_alive"] and outcome["canary_intact"]
    for i in range(len(ATTACKS)):
        m = _mark(i)
        for path in (
            f"{SITE}/evil-{m}.pth",
            f"/usr/lib/evil-{m}",
            f"{STDLIB}/evil_{m}.py",
            f"{STDLIB}/evil-{m}",
            f"/evil-{m}",
            f"/etc/evil-{m}",
            f"{os.path.dirname(sys.executable)}/evil-{m}",
        ):
            assert not os.path.lexists(path), path
    assert [r.status for r in outcome["plain"]] == ["ok"] * len(PLAIN)
    assert [r.output.strip() for r in outcome["plain"]] == [str(sum(range(n))) for n in range(len(PLAIN))]
