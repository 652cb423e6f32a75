"""`trace-mega demo` and `eval` as a user runs them (shortened), in a real subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_mega.kernels._triton_env import env_without_interpreter

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["steps=2", "allocation.prompts_per_step=8", "allocation.root_rollouts_per_step=12", "rollout.max_turns=4",
         "telemetry.tensorboard=false", "telemetry.progress_bars=false"]


def _run(args, timeout=400):
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trace_mega.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_demo_writes_a_report_comparing_uniform_and_trace(tmp_path):
    proc = _run(["demo", "--out", str(tmp_path), *SHORT])
    report = (tmp_path / "report.md").read_text()
    assert "| uniform |" in report and "| trace |" in report and "effective_ratio_mean" in report
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    for method in ("uniform", "trace"):
        assert len((tmp_path / method / "metrics.jsonl").read_text().splitlines()) == 2
    assert "report:" in proc.stdout


@pytest.mark.slow
def test_eval_reports_pass_at_k(tmp_path):
    proc = _run(["eval", "--config", "demo_cpu", "--samples", "4", "--k", "1,4", "--max-tasks", "6", *SHORT,
                 f"telemetry.out_dir={tmp_path}"])
    assert "| test | tasks | mean@4 | pass@1 | pass@4 |" in proc.stdout and "| **all** | 6 |" in proc.stdout
    report = json.loads((tmp_path / "eval" / "test.json").read_text())
    row = report["rows"]["all"]
    assert report["n"] == 4 and report["ks"] == [1, 4] and len(report["tasks"]) == 6
    assert 0.0 <= row["pass@1"] <= row["pass@4"] <= 1.0 and row["pass@1"] == pytest.approx(row["mean@4"])
