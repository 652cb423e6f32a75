"""`trace-mega demo` and `eval` as a user runs them (shortened), in a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_mega.kernels._triton_env import env_without_interpreter

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "steps=2",
    "allocation.prompts_per_step=8",
    "allocation.root_rollouts_per_step=12",
    "rollout.max_turns=4",
    "telemetry.tensorboard=false",
    "telemetry.progress_bars=false",
]


def _run(args, timeout=400):
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "trace_mega", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_demo_writes_the_three_arm_report_over_seeds(tmp_path):
    from trace_mega.commands.demo import REPORT_KEYS

    proc = _run(["demo", "--out", str(tmp_path), "--seeds", "2", "--from-scratch", *SHORT])
    report = (tmp_path / "report.md").read_text()
    for method in ("uniform", "treepo", "trace"):
        assert f"| {method} |" in report and f"| {method} seed 1 |" in report
        for seed in (0, 1):
            assert len((tmp_path / method / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()) == 2
    table = json.loads((tmp_path / "report.json").read_text())
    assert list(table) == ["uniform", "treepo", "trace"]
    assert all(list(row) == list(REPORT_KEYS) for row in table.values())
    assert table["uniform"]["predictor_fallback_frac"] == 0.0 and table["trace"]["trajectories_per_step"] == 24
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "report:" in proc.stdout


@pytest.mark.slow
def test_demo_starts_every_arm_from_the_cached_warm_start(tmp_path):
    import yaml

    pre = yaml.safe_load((ROOT / "configs" / "pretrain_tools.yaml").read_text())
    pre |= {"steps": 2, "episodes_per_step": 4, "micro_batch_episodes": None, "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "pre.yaml").write_text(yaml.safe_dump(pre))
    _run(
        [
            "demo",
            "--out",
            str(tmp_path / "demo"),
            "--pretrain-config",
            str(tmp_path / "pre.yaml"),
            "steps=1",
            *SHORT[1:],
        ]
    )
    (ckpt,) = (tmp_path / "cache").iterdir()  # one checkpoint, trained once for the three arms
    assert (ckpt / "config.json").exists()
    for method in ("uniform", "treepo", "trace"):
        run = yaml.safe_load((tmp_path / "demo" / method / "seed0" / "config.yaml").read_text())
        assert run["model"]["hf_checkpoint"] == str(ckpt)


@pytest.mark.slow
def test_eval_reports_pass_at_k(tmp_path):
    proc = _run(
        [
            "eval",
            "--config",
            "demo_cpu",
            "--samples",
            "4",
            "--k",
            "1,4",
            "--max-tasks",
            "6",
            *SHORT,
            f"telemetry.out_dir={tmp_path}",
        ]
    )
    assert "| test | tasks | mean@4 | pass@1 | pass@4 |" in proc.stdout and "| **all** | 6 |" in proc.stdout
    report = json.loads((tmp_path / "eval" / "test.json").read_text())
    row = report["rows"]["all"]
    assert report["n"] == 4 and report["ks"] == [1, 4] and len(report["tasks"]) == 6
    assert 0.0 <= row["pass@1"] <= row["pass@4"] <= 1.0 and row["pass@1"] == pytest.approx(row["mean@4"])


def test_collapse_detection_and_pooled_skill():
    from trace_mega.commands.demo import collapsed, pooled_skill

    learn = [{"reward/mean": 0.3, "loss/token_entropy": 1.0}]
    assert collapsed(learn + [{"reward/mean": 0.0, "loss/token_entropy": 0.05}])
    assert not collapsed(learn + [{"reward/mean": 0.0, "loss/token_entropy": 0.5}])  # still exploring
    assert not collapsed([{"reward/mean": 0.0, "loss/token_entropy": 0.05}])  # never learned: not a collapse
    rows = [
        {
            "predictor/skill": float("nan"),
            "predictor/brier": 9.0,
            "predictor/brier_constant": 1.0,
            "predictor/samples": 10,
        },  # the first fit has no held-out constant: left out
        {"predictor/skill": 0.5, "predictor/brier": 0.1, "predictor/brier_constant": 0.2, "predictor/samples": 10},
        {"predictor/skill": -4.0, "predictor/brier": 0.01, "predictor/brier_constant": 0.002, "predictor/samples": 10},
    ]
    assert pooled_skill(rows) == pytest.approx(1 - 0.11 / 0.202)
    # the roots' own pooled skill reads the root_ keys
    roots = [{k.replace("predictor/", "predictor/root_"): v for k, v in r.items()} for r in rows]
    assert pooled_skill(roots, "root_") == pytest.approx(1 - 0.11 / 0.202)
