"""End-to-end trainer runs on CPU: each a real `trace-mega train` process (megatron + gloo)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace_mega.kernels._triton_env import env_without_interpreter

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
SMALL = [
    "allocation.prompts_per_step=8",
    "allocation.root_rollouts_per_step=12",
    "rollout.max_turns=4",
    "telemetry.tensorboard=false",
    "telemetry.progress_bars=false",
]


def _env():
    return env_without_interpreter() | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _train(out: Path, *overrides: str, timeout: int = 300) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(CONFIG),
        *SMALL,
        f"telemetry.out_dir={out}",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _rows(out)


def kill_once_two_steps_logged(proc: subprocess.Popen, out: Path, kill) -> None:
    """Call `kill` once step 1 is in `out`'s metrics, i.e. while step 2 is in flight (or being
    checkpointed); fails if the run ends first."""
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    kill()
    proc.wait()


def _rows(out: Path) -> list[dict]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


@pytest.mark.slow
@pytest.mark.parametrize("allocator", ["trace", "uniform"])
def test_two_steps_equal_budget(tmp_path, allocator):
    rows = _train(tmp_path, "steps=2", f"allocation.name={allocator}")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        # Equal budget: M root rollouts * (1 + N) trajectories, whatever the allocator (here every
        # prompt given rollouts has a prefix to branch from, so trace spends its whole budget too).
        assert r["alloc/trajectories"] == 24 and r["alloc/budget_unspent"] == 0.0 and r["loss/skipped"] == 0.0
        assert 0.0 <= r["alloc/effective_ratio"] <= 1.0 and r["rollout/generated_tokens"] > 0
        assert r["loss/units"] > 0 and "predictor/brier" in r
    assert (tmp_path / "reliability.png").exists()


@pytest.mark.slow
def test_trace_c_credit_and_kl(tmp_path):
    rows = _train(tmp_path, "steps=1", "credit.enabled=true", "credit.answer_template=goal", "loss.kl_coef=0.01")
    assert rows[0]["loss/kl_ref"] >= 0.0 and rows[0]["loss/skipped"] == 0.0
    assert rows[0]["loss/token_entropy"] > 0.0 and rows[0]["time/credit_s"] > 0.0


@pytest.mark.slow
def test_invalid_config_names_the_field(tmp_path):
    cmd = [sys.executable, "-m", "trace_mega", "train", "--config", str(CONFIG), "allocation.nme=trace"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "allocation.nme: unknown key for AllocationConfig" in proc.stderr


@pytest.mark.slow
def test_torchrun_tp2_two_steps(tmp_path):
    from trace_mega.learner.parallel import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(CONFIG),
        *SMALL,
        "steps=2",
        "parallel.tensor_model_parallel_size=2",
        f"telemetry.out_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and all(r["loss/skipped"] == 0.0 for r in rows)
