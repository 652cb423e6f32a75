"""`trace-mega sweep`: grid parsing, validation before any run, failed points, and a DP 1 / 2 sweep on CPU."""

import json
import math
import sys
from pathlib import Path

import pytest
from test_trainer import SMALL  # the tiny demo overrides every trainer test uses

from trace_mega.commands.sweep import (
    Grid,
    main,
    markdown,
    plot,
    point_name,
    run_point,
    run_sweep,
    split_values,
    summarize,
)
from trace_mega.config import ConfigError
from trace_mega.kernels._triton_env import INTERPRET_VAR

ROOT = Path(__file__).resolve().parents[2]


def test_values_split_outside_brackets_and_quotes():
    assert split_values("1,2") == ["1", "2"]
    assert split_values("[1,2],{a: 1, b: 2},'x,y'") == ["[1,2]", "{a: 1, b: 2}", "'x,y'"]
    for bad in ("[1,2", "1,,2", "'a,b"):
        with pytest.raises(ValueError):
            split_values(bad)


def test_grid_axes_fixed_overrides_and_points():
    g = Grid.parse(["nproc=1,2", "parallel.expert_model_parallel_size=1,2", "steps=3", "x.y=[1,2]"])
    assert g.axes == [("nproc", ["1", "2"]), ("parallel.expert_model_parallel_size", ["1", "2"])]
    assert g.fixed == ["steps=3", "x.y=[1,2]"]
    assert g.points() == [
        {"nproc": "1", "parallel.expert_model_parallel_size": "1"},
        {"nproc": "1", "parallel.expert_model_parallel_size": "2"},
        {"nproc": "2", "parallel.expert_model_parallel_size": "1"},
        {"nproc": "2", "parallel.expert_model_parallel_size": "2"},
    ]
    assert Grid.parse(["nproc=2"]).axes == [("nproc", ["2"])]  # one process count is still the points' launcher
    assert point_name(3, {"nproc": "2", "parallel.tensor_model_parallel_size": "2"}) == (
        "03_nproc=2_tensor_model_parallel_size=2"
    )
    for bad in (["nproc=0,1"], ["a=1", "a=2"], ["novalue"]):
        with pytest.raises(ValueError):
            Grid.parse(bad)


def test_summary_skips_warmup_takes_peak_memory_max_and_ignores_nonfinite():
    rows = [
        {"time/step_s": 9.0, "perf/peak_memory_gib": 1.0, "reward/mean": 0.0},
        {"time/step_s": 1.0, "perf/peak_memory_gib": 3.0, "reward/mean": float("nan")},
        {"time/step_s": 3.0, "perf/peak_memory_gib": 2.0, "reward/mean": 0.5, "eval/test/reward": 0.25},
    ]
    s = summarize(rows, warmup_steps=1)
    assert s["time/step_s"] == 2.0 and s["perf/peak_memory_gib"] == 3.0 and s["reward/mean"] == 0.5
    assert summarize(rows[:1], warmup_steps=1)["time/step_s"] == 9.0  # nothing after the warm-up: all steps
    assert "mismatch/k3" not in s and s["eval/test/reward"] == 0.25  # the last eval, whenever it ran


def test_every_point_is_validated_before_any_runs(tmp_path):
    # The second point's value is bad: the sweep fails naming it, and the first point never ran.
    with pytest.raises(ConfigError, match=r"sweep point 01_max_turns=-1.*max_turns"):
        run_sweep(
            str(ROOT / "configs" / "demo_cpu.yaml"),
            ["rollout.max_turns=2,-1"],
            steps=1,
            warmup_steps=0,
            out_dir=str(tmp_path),
        )
    assert not any(tmp_path.iterdir())
    assert main(["--config", "demo_cpu", "--out", str(tmp_path), "no.such_key=1,2"]) == 2


def test_a_failed_point_reports_its_exit_code_and_last_error(tmp_path):
    cmd = [sys.executable, "-c", "print('starting'); raise SystemExit('RuntimeError: tensor parallel 2 > world 1')"]
    res = run_point(cmd, tmp_path / "p", env=None)
    assert res["exit_code"] == 1 and res["error"] == "RuntimeError: tensor parallel 2 > world 1"
    assert (tmp_path / "p" / "sweep_point.log").read_text().startswith("starting")


@pytest.mark.slow
def test_the_replay_probe_gets_a_column_and_its_own_bars(tmp_path):
    """Points with `moe/own_routing_k3` (model.moe_replay_probe) show it beside `mismatch/k3`; a sweep
    without the probe has no such column."""
    base = {"time/step_s": 1.0, "perf/peak_memory_gib": 1.0, "mismatch/k3": 2e-5}
    report = {
        "config": "demo_moe_cpu.yaml",
        "steps": 3,
        "warmup_steps": 1,
        "axes": [["seed", ["0", "1"]]],
        "fixed": [],
        "command": "trace-mega sweep ...",
        "points": [
            {"values": {"seed": str(i)}, "exit_code": 0, "error": "", "metrics": base | {"moe/own_routing_k3": 3e-5}}
            for i in range(2)
        ],
    }
    md = markdown(report)
    assert "k3 own routing" in md and "| 3.0e-05 |" in md
    plot(report, tmp_path / "probe.png")
    assert (tmp_path / "probe.png").stat().st_size > 10_000
    for p in report["points"]:
        del p["metrics"]["moe/own_routing_k3"]
    assert "k3 own routing" not in markdown(report)


def test_sweep_over_one_and_two_processes_writes_table_json_and_plot(tmp_path, monkeypatch):
    """DP 1 and DP 2 (torchrun, gloo) of the tiny demo config, 2 steps each: both rows carry
    throughput per GPU, step-time phases, peak memory and mismatch."""
    monkeypatch.delenv(INTERPRET_VAR, raising=False)  # the points inherit this process's environment
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = main(["--config", "demo_cpu", "--steps", "2", "--out", str(tmp_path), "nproc=1,2", *SMALL])
    assert code == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["values"] for p in report["points"]] == [{"nproc": "1"}, {"nproc": "2"}]
    for p in report["points"]:
        m = p["metrics"]
        assert p["exit_code"] == 0 and p["steps_logged"] == 2
        for key in ("time/step_s", "time/rollout_s", "time/train_s", "perf/peak_memory_gib", "mismatch/k3"):
            assert math.isfinite(m[key]), key
        assert m["perf/generated_tokens_per_s_per_gpu"] > 0 and m["perf/trained_tokens_per_s_per_gpu"] > 0
    md = (tmp_path / "sweep.md").read_text()
    assert md.count("| ok |") == 2 and "gen tok/s/GPU" in md
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
