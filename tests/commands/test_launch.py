"""SLURM -> torchrun: node lists, the arguments per node, the sbatch script's wiring, a real rendezvous."""

import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace_mega.commands.launch import expand_nodelist, main, run_torchrun, torchrun_args
from trace_mega.stopping import EXIT_FILE_ENV

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("a[098-101],login2", ["a098", "a099", "a100", "a101", "login2"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[1,3]y,z[5]", ["x1y", "x3y", "z5"]),
    ],
)
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["", "n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "a,,b"])
def test_bad_nodelists(spec):
    with pytest.raises(ValueError):
        expand_nodelist(spec)


def test_torchrun_args_from_slurm_variables():
    env = {
        "SLURM_JOB_NODELIST": "node[01-03,07]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_ID": "123456",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_NODEID": "2",
    }
    assert torchrun_args(env) == [
        "--nnodes",
        "4",
        "--nproc-per-node",
        "8",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node01:32956",
        "--rdzv-id",
        "trace-mega-123456",
    ]
    alt = {
        "SLURM_NODELIST": "gpu[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "7",
        "SLURM_GPUS_PER_NODE": "h100:4",
        "MASTER_PORT": "6000",
    }
    args = torchrun_args(alt)
    assert args[args.index("--nproc-per-node") + 1] == "4" and args[args.index("--rdzv-endpoint") + 1] == "gpu1:6000"
    bare = torchrun_args({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1"}, port=1234)
    assert bare[bare.index("--nproc-per-node") + 1] == "gpu" and "n1:1234" in bare
    assert torchrun_args({**env, "SLURM_GPUS_ON_NODE": ""}, nproc_per_node="2")[3] == "2"
    with pytest.raises(ValueError, match="3 nodes but"):
        torchrun_args({**env, "SLURM_JOB_NUM_NODES": "3"})
    with pytest.raises(KeyError, match="SLURM_JOB_NODELIST"):
        torchrun_args({})


def test_dry_run_prints_the_command(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert main(["--dry-run", "--", "train", "--config", "demo_cpu", "steps=3"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "node1:29542" in cmd
    assert cmd[cmd.index("-m", 3) :] == ["-m", "trace_mega", "train", "--config", "demo_cpu", "steps=3"]
    assert main(["train"]) == 2  # no "--"


def test_sbatch_runs_one_launcher_per_node_through_srun(tmp_path):
    """The batch script under a stand-in `srun` that records its options and runs the task."""
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text(
        '#!/usr/bin/env bash\necho "srun $*" > "$SRUN_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(
        os.environ,
        PATH=f"{fake.parent}:{os.environ['PATH']}",
        SRUN_LOG=str(tmp_path / "srun.log"),
        PYTHON=sys.executable,
        LAUNCH_ARGS="--dry-run",
        SLURM_JOB_NODELIST="gpu[3-4]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="9",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_ON_NODE="64",
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/train.sbatch"), "qwen3_14b_multihop", "steps=5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    srun = (tmp_path / "srun.log").read_text()
    assert "--ntasks-per-node=1" in srun and "--cpus-per-task=64" in srun and "--cpu-bind=none" in srun
    cmd = shlex.split(proc.stdout)
    assert "gpu3:29509" in cmd and cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[-5:] == ["trace_mega", "train", "--config", "qwen3_14b_multihop", "steps=5"]


def test_sbatch_passes_usr1_to_srun_and_requeues_on_a_clean_stop(tmp_path):
    """SLURM's warning (USR1 to the batch shell, `--signal=B:USR1@120`) reaches srun; a run that stops
    cleanly (exit 75, here a stand-in srun) has the script requeue the job and exit 75 itself."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "srun": 'trap \'echo "$*" > "$LOG/srun"; exit 75\' USR1\ntouch "$LOG/ready"\nwhile :; do sleep 0.05; done\n',
        "scontrol": 'echo "$*" > "$LOG/scontrol"\n',
    }.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(tmp_path), SLURM_JOB_ID="9")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/slurm/train.sbatch"), "demo_cpu"], cwd=ROOT, env=env)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == 75
    finally:
        proc.kill()
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "9"]
    assert "trace_mega.commands.launch" in (tmp_path / "srun").read_text()


def test_the_launcher_exits_with_the_code_a_worker_wrote(tmp_path):
    """torchrun exits 1 whatever its workers' codes; a worker's clean stop (its code in the file the
    launcher names) becomes the launcher's exit code, a crash stays torchrun's."""
    write = f"import os, pathlib; pathlib.Path(os.environ[{EXIT_FILE_ENV!r}]).write_text('75\\n'); raise SystemExit(1)"
    assert run_torchrun([sys.executable, "-c", write]) == 75
    assert run_torchrun([sys.executable, "-c", "raise SystemExit(1)"]) == 1
    assert run_torchrun([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]) == 137


@pytest.mark.slow
def test_rendezvous_on_the_first_node_starts_the_workers(tmp_path):
    """A real torchrun from the launcher: c10d rendezvous on this host, two workers, each
    running the CLI (`train --help` exits at once, so only the launch is timed)."""
    env = dict(
        os.environ, SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="1", OMP_NUM_THREADS="1"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trace_mega.commands.launch",
            "--nproc-per-node",
            "2",
            "--port",
            str(port),
            "--",
            "train",
            "--help",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("usage: trace-mega train") == 2
