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
def test_demo_writes_the_four_arm_report_over_seeds(tmp_path):
    from trace_mega.commands.demo import LEARNING_KEYS, METHODS, REPORT_KEYS

    evals = ["eval.every_steps=1", "eval.samples_per_task=2"]
    proc = _run(["demo", "--out", str(tmp_path), "--seeds", "2", "--from-scratch", *SHORT, *evals])
    report = (tmp_path / "report.md").read_text()
    for method in METHODS:
        assert f"| {method} |" in report and f"| {method} seed 1 |" in report
        for seed in (0, 1):
            assert len((tmp_path / method / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()) == 2
    out = json.loads((tmp_path / "report.json").read_text())
    table = out["methods"]
    assert list(table) == list(METHODS) == ["uniform", "dapo", "treepo", "trace"]
    assert all(set(REPORT_KEYS) | set(LEARNING_KEYS) <= set(row) for row in table.values())
    assert table["uniform"]["predictor_fallback_frac"] == 0.0 and table["trace"]["trajectories_per_step"] == 24
    assert table["dapo"]["trajectories_per_step"] <= 24  # generated, dropped groups included
    # the threshold is uniform's final held-out eval reward, mean over the seeds
    assert out["threshold"] == pytest.approx(sum(table["uniform"]["eval_reward_final_per_seed"]) / 2)
    # on the seed-mean curve uniform reaches its own mean final, at its last evaluation at the latest
    assert table["uniform"]["trajectories_to_threshold"] <= table["uniform"]["eval_curve"][-1][0] == 48.0
    for row in table.values():
        assert [x for x, _ in row["eval_curve"]] == [24.0, 48.0] or row is table["dapo"]  # evals at steps 1, 2
        assert row["eval_reward_final"] == pytest.approx(sum(row["eval_reward_final_per_seed"]) / 2)
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and (tmp_path / "eval_curves.png").exists()
    assert "report:" in proc.stdout and "trajectories_to_threshold" in proc.stdout
    # a finished arm is reused, not trained again
    again = _run(["demo", "--out", str(tmp_path), "--methods", "uniform", "--from-scratch", *SHORT, *evals])
    assert "finished before with this config, reused" in again.stdout


def test_learning_curve_measures():
    from trace_mega.commands.demo import curve_auc, eval_curve, first_reaching, forgetting

    rows = [
        {"alloc/generated_trajectories": 10, "rollout/generated_tokens": 100},
        {
            "alloc/generated_trajectories": 10,
            "rollout/generated_tokens": 100,
            "eval/test/reward": 0.2,
            "eval/test/a/mean@8": 0.5,
            "eval/test/b/mean@8": 0.1,
            "eval/test/macro/mean@8": 0.3,
        },
        {"alloc/generated_trajectories": 6, "rollout/generated_tokens": 50},
        {
            "alloc/generated_trajectories": 4,
            "rollout/generated_tokens": 50,
            "eval/test/reward": 0.6,
            "eval/test/a/mean@8": 0.3,
            "eval/test/b/mean@8": 0.4,
            "eval/test/macro/mean@8": 0.35,
        },
    ]
    curve = eval_curve(rows)
    assert curve == [[20.0, 0.2], [30.0, 0.6]]  # trajectories generated up to and including the eval step
    assert eval_curve(rows, tokens=True) == [[200.0, 0.2], [300.0, 0.6]]
    assert first_reaching(curve, 0.5) == 30.0 and first_reaching(curve, 0.2) == 20.0
    assert first_reaching(curve, 0.7) is None
    assert curve_auc(curve, 30.0) == pytest.approx(0.4)  # the mean of a straight line from 0.2 to 0.6
    assert curve_auc(curve, 25.0) == pytest.approx(0.3)  # cut at 25 (0.4 there): mean of 0.2..0.4
    assert curve_auc([[5.0, 0.7]], 5.0) == 0.7
    assert curve_auc([[5.0, 0.7], [9.0, 0.9]], 5.0) == 0.7  # cut at its first point: that point alone
    assert forgetting(rows) == {"a": pytest.approx(0.2), "b": 0.0}  # macro is not a level


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
