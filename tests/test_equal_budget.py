"""End to end: every allocator spends exactly M·(1+N) trajectories on every step (dapo at most that
many, counted as generated, dropped groups included), and a multi-mini-batch update of the demo
actually clips. Real trainer runs (megatron + gloo on CPU) in one subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXACT = ["uniform", "pcl", "treepo", "trace", "trace_global"]
ALLOCATORS = [*EXACT, "dapo"]
RUNS = {a: [f"allocation.name={a}"] for a in EXACT} | {
    "dapo": ["allocation.name=dapo", "allocation.dapo_groups_per_round=2"]
}
"""One run per allocator; dapo draws 2 prompts a round, so its budget takes several rounds."""

# Runs each allocator (or override set) in turn in one process, writing its metrics rows as JSON.
SCRIPT = """
import json, sys
from trace_mega.config import TrainConfig, load_yaml
from trace_mega.trainer import Trainer
out, runs, common = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
result = {}
for name, overrides in runs.items():
    cfg = load_yaml(TrainConfig, "configs/demo_cpu.yaml", common + overrides + [f"telemetry.out_dir={out}/{name}"])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    result[name] = [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")]
json.dump(result, open(f"{out}/result.json", "w"))
"""


def _run(tmp_path, runs: dict, common: list, timeout: int = 600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    common = common + ["telemetry.tensorboard=false", "telemetry.progress_bars=false"]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(runs), json.dumps(common)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


def _check_equal_budget(result: dict, steps: int, total: int) -> None:
    for name in ALLOCATORS:
        rows = result[name]
        assert [r["step"] for r in rows] == list(range(steps)), name
        assert all(r["loss/skipped"] == 0.0 and r["alloc/invalid_predictions"] == 0.0 for r in rows), name
        generated = [r["alloc/generated_trajectories"] for r in rows]
        assert generated == [total - r["alloc/budget_unspent"] for r in rows], name
        if name in EXACT:  # every trajectory generated is trained on
            assert generated == [r["alloc/trajectories"] for r in rows] == [float(total)] * steps, name
            continue
        for r in rows:  # dapo: at most the budget, all of it unless its target batch filled first
            gen = r["alloc/generated_trajectories"]
            assert 0 < gen == r["alloc/dapo_rounds"] * 2 * 4 <= total and r["alloc/trajectories"] <= gen
            assert gen == total or r["alloc/kept_groups"] == total // 4


@pytest.mark.slow  # ~1 min on a loaded 2-core CPU: six trainer set-ups (the unit test is tests/allocation)
def test_every_allocator_spends_the_budget_every_step_small(tmp_path):
    # M = 8 roots and N = 3: 32 trajectories per step. At most 2 turns (so at most one intermediate
    # prefix per rollout, none when it answers at once) and 1 continuation per prefix: the caps
    # bind everywhere, so the tree allocators must spend the rest as fresh root rollouts.
    small = [
        "steps=2",
        "allocation.prompts_per_step=8",
        "allocation.root_rollouts_per_step=8",
        "allocation.rollouts_per_prompt_max=4",
        "allocation.group_size=4",
        "rollout.max_turns=2",
        "allocation.continuations_per_rollout=3.0",
        "allocation.continuations_per_prefix_max=1",
        "predictor.updates_per_step=2",
    ]
    result = _run(tmp_path, RUNS, small)
    _check_equal_budget(result, 2, 32)
    for name in ("treepo", "trace", "trace_global"):
        assert all(r["alloc/root_continuations"] >= 16 for r in result[name]), name


@pytest.mark.slow
def test_every_allocator_three_demo_steps_logs_64_trajectories(tmp_path):
    _check_equal_budget(_run(tmp_path, RUNS, ["steps=3"]), 3, 64)


@pytest.mark.slow
def test_demo_with_four_mini_batches_clips(tmp_path):
    # The `synthetic` env rewards the random policy from step 0 (the demo's own env may not in three
    # steps), so advantages are non-zero and the later mini-batches see moved weights.
    result = _run(
        tmp_path,
        {"mb4": ["optim.mini_batches_per_step=4", "optim.lr=5e-2"]},
        ["steps=3", "env.name=synthetic", "env.options={num_tasks: 16}"],
    )
    rows = result["mb4"]
    assert all(r["loss/optimizer_steps"] == 4.0 for r in rows)
    assert max(r["loss/clip_fraction"] for r in rows) > 0.0
    assert max(r["loss/ratio_max"] for r in rows) > 1.0
