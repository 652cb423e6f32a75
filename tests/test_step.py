"""The step record (`trace_mega/step.py`) and the step's data flow through a real trainer (docs/step.md).

The unit tests build a `StepBatch` by hand and grow it the way the rollout
stages do. The trainer test runs `Trainer` (megatron + gloo, CPU) in a
subprocess (this file is its script) with a forward hook on the policy: it
counts the tokens each step forwards, checks that the step's one layout
equals a fresh pack of its final trees, and drives the predictor fallback
guard with a predictor forced worse, or better, than a constant.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trace_mega.config import PredictorConfig
from trace_mega.envs.base import Task
from trace_mega.predictor import build_predictor
from trace_mega.rollout.tree import Node, RolloutTree, pack
from trace_mega.step import StepBatch

ROOT = Path(__file__).resolve().parent.parent


def _turn(tok, n=2):
    return Node(-1, [tok] * n, [1] * n, [-0.5] * n)


def _assert_same_layout(a, b):
    for k, v in a.__dict__.items():
        w = b.__dict__[k]
        assert (v.dtype == w.dtype and torch.equal(v, w)) if isinstance(v, torch.Tensor) else v == w, k


def _bare(task, prompt, m, seed):
    """What the agent loop returns for one task: a new tree, `m` bare rollouts of two turns."""
    t = RolloutTree(task.task_id, prompt)
    for j in range(m):
        mid = t.add_node(0, _turn(10 + j))
        t.add_path(mid, [_turn(20 + j, 3)], float((seed + j) % 2))
    return t


def test_the_step_layout_is_extended_as_the_trees_grow():
    tasks = [Task(f"t{i}", []) for i in range(4)]
    prompts = [[1] * (3 + i) for i in range(4)]
    batch = StepBatch.from_prompts(0, tasks, prompts)
    assert batch.root_nodes().tolist() == [0, 1, 2, 3] and batch.packed.num_tokens == sum(map(len, prompts))
    batch.rollouts = torch.tensor([2, 0, 3, 0])
    bare = [_bare(t, p, int(m), i) for i, (t, p, m) in enumerate(zip(tasks, prompts, batch.rollouts))]
    batch.grow(bare, keep=[0, 2])  # prompts given no rollouts leave the step
    assert batch.trees == [bare[0], bare[2]] and batch.prompt_index.tolist() == [0, 2]
    _assert_same_layout(batch.packed, pack(batch.trees))
    batch.prefixes = cand = batch.prefix_candidates()
    # Every first turn is an intermediate prefix; its group is the candidate prompt (indexes `rollouts`).
    assert cand.group.tolist() == [0, 0, 2, 2, 2] and cand.local == [(0, 1), (0, 3), (1, 1), (1, 3), (1, 5)]
    assert cand.r.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    batch.continuations = torch.tensor([0, 2, 1, 0, 0])
    assert batch.branch_points() == [(0, 3, 2), (1, 1, 1)]
    for ti, node, k in batch.branch_points():  # what AgentLoop.expand does, in place
        for _ in range(k):
            batch.trees[ti].add_path(node, [_turn(30)], 1.0)
    batch.grow(batch.trees)
    _assert_same_layout(batch.packed, pack(batch.trees))
    assert batch.packed.leaf_nodes.numel() == int(batch.rollouts.sum() + batch.continuations.sum())
    with pytest.raises(ValueError, match="3 trees for a step of 2"):
        batch.grow(batch.trees + batch.trees[:1])


def test_step_metrics_count_each_eval_group_prompts_and_contrasted_prompts():
    from trace_mega.telemetry import tree_metrics

    # Three candidates of two levels; the ice1 one gets no rollouts and leaves the step.
    tasks = [Task("a", [], meta={"benchmark": "ice0"}), Task("b", [], meta={"benchmark": "ice1"})]
    tasks.append(Task("c", [], meta={"benchmark": "ice0"}))
    batch = StepBatch.from_prompts(0, tasks, [[1], [2], [3]])
    trees = [_bare(t, [i + 1], 2, seed) for i, (t, seed) in enumerate(zip(tasks, (0, 0, 1)))]
    trees[2] = RolloutTree("c", [3])  # all-0: two failures
    for _ in range(2):
        trees[2].add_path(0, [_turn(9)], 0.0)
    batch.grow(trees, keep=[0, 2])
    assert batch.eval_groups() == ["ice0", "ice0"]
    m = tree_metrics(batch.packed, batch.eval_groups())
    assert m["alloc/group/ice0/prompts"] == 2.0 and m["alloc/group/ice0/contrasted_prompts"] == 1.0
    assert not any("ice1" in k for k in m)  # a level the step does not hold is absent, not 0
    assert m["alloc/contrasted_prompts"] == 1.0
    # A task without a group (no benchmark key): no per-group counts at all.
    bare = StepBatch.from_prompts(0, [Task("d", [])], [[4]])
    assert bare.eval_groups() is None and not any("/group/" in k for k in tree_metrics(bare.packed, None))


def test_prefix_candidates_leave_out_prefixes_too_close_to_the_turn_limit():
    # One bare rollout of 4 turns: intermediate prefixes after turns 1, 2, 3 (depths 1-3).
    task = Task("t", [])
    batch = StepBatch.from_prompts(0, [task], [[1, 2]])
    tree = RolloutTree(task.task_id, [1, 2])
    tree.add_path(0, [_turn(10), _turn(11), _turn(12), _turn(13)], 1.0)
    batch.grow([tree])
    assert [tree.depth(n) for _, n in batch.prefix_candidates().local] == [1, 2, 3]
    # max_turns 4, min_turns_left 2: a continuation from depth 3 would have one turn, room for an answer only.
    cand = batch.prefix_candidates(max_depth=4 - 2)
    assert [tree.depth(n) for _, n in cand.local] == [1, 2] and cand.node.numel() == cand.group.numel() == 2
    assert batch.prefix_candidates(max_depth=0).node.numel() == 0


def test_predictor_fits_on_the_update_share_of_the_step():
    tasks = [Task("a", []), Task("b", [])]
    batch = StepBatch.from_prompts(0, tasks, [[1, 2], [3]])
    batch.grow([_bare(t, p, 2, i) for i, (t, p) in enumerate(zip(tasks, [[1, 2], [3]]))])
    pred = build_predictor(PredictorConfig(replay_steps=2), hidden_size=4, vocab_size=8)
    hidden = torch.nn.functional.one_hot(batch.packed.tokens % 4, 4).float()  # what the update returns
    fit = pred.fit_step(batch.packed, hidden, [0, 1])
    assert fit.metrics["predictor/samples"] == 2 + 4 and len(pred.replay) == 1  # roots + first turns; window 1
    assert fit.calibration is not None and "_calibration" not in fit.metrics
    assert pred.replay[0][0] is batch.packed and pred.replay[0][2] is hidden
    # One data-parallel rank's share: tree 1 alone, its hidden rows; the window keeps the share.
    rows = batch.packed.tree_tokens([1])
    out = pred.fit_step(batch.packed, hidden[rows], [1]).metrics
    assert out["predictor/samples"] == 2 + 4  # the whole step's count, for the loss and the calibration
    share_packed, share_samples, _ = pred.replay[-1]
    assert share_packed.num_trees == 1 and share_samples.total == 6 and share_samples.node.numel() == 3


# --- the step's data flow in a real trainer ---------------------------------------------------


RUNS = ("real", "oracle", "worse")


def worker(out_path: str) -> None:
    """The trainer runs of `RUNS`, one after the other in this process; per run, per step, the tokens
    forwarded with / without grad and the layout sizes."""
    Path(out_path).write_text(json.dumps({run: _trainer_run(Path(out_path).parent / run, run) for run in RUNS}))


def _trainer_run(out_dir: Path, run: str) -> list[dict]:
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.rollout.tree import pack as fresh_pack
    from trace_mega.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_yaml(
        TrainConfig,
        ROOT / "configs" / "demo_cpu.yaml",
        [
            "steps=3",
            "allocation.name=trace",
            "allocation.prompts_per_step=8",
            "allocation.root_rollouts_per_step=12",
            "rollout.max_turns=4",
            "telemetry.tensorboard=false",
            "telemetry.progress_bars=false",
            # the synthetic env pays from step 0: the forced predictors' targets are not all 0
            "env.name=synthetic",
            "env.options={num_tasks: 16}",
            f"telemetry.out_dir={out_dir}",
        ],
    )
    trainer = Trainer(cfg)
    forwards, sizes, steps = [], {}, []
    trainer.learner.policy.register_forward_pre_hook(
        lambda mod, args: forwards.append((int(args[0].shape[1]), torch.is_grad_enabled()))
    )

    roll_out, expand, train_step = trainer.rollouts.roll_out, trainer.rollouts.expand, trainer.learner.train_step
    final = []

    def recorded_roll_out(tasks, trees, counts, seed):
        sizes["all_roots"] = fresh_pack(trees).num_tokens  # the roots of every candidate prompt
        out = roll_out(tasks, trees, counts, seed)
        sizes["bare"] = fresh_pack([t for t, m in zip(out, counts) if m > 0]).num_tokens  # prompts given none leave
        return out

    def recorded_expand(trees, points, seed):
        sizes["branch_depths"] = [trees[t].depth(n) for t, n, _ in points if n != 0]  # 0: fresh root rollouts
        final[:] = expand(trees, points, seed)
        sizes["final"] = fresh_pack(final).num_tokens
        sizes["roots"] = sum(len(t.nodes[0].token_ids) for t in final)
        return final

    def checked_train_step(packed, advantages, **kw):
        _assert_same_layout(packed, fresh_pack(final))  # the extended layout is the fresh pack of the final trees
        return train_step(packed, advantages, **kw)

    trainer.rollouts.roll_out, trainer.rollouts.expand = recorded_roll_out, recorded_expand
    trainer.learner.train_step = checked_train_step
    if run != "real":  # a predictor forced better (the targets) or worse (1 - targets) than any constant

        def forced(packed, nodes, hidden=None):
            v = (packed.node_reward_sum[nodes] / packed.node_leaf_count[nodes].clamp(min=1)).float()
            return v if run == "oracle" else 1.0 - v

        trainer.predictor.predict = forced
    real_log = trainer.sink.log

    def log(step, metrics, tag=""):
        steps.append(
            {
                "tag": tag,
                "fallback": metrics["alloc/fallback"],
                "skill": metrics.get("predictor/skill"),
                "no_grad": sum(n for n, g in forwards if not g),
                "grad": sum(n for n, g in forwards if g),
                "trajectories": metrics["alloc/trajectories"],
                "unspent": metrics["alloc/budget_unspent"],
                **sizes,
            }
        )
        forwards.clear()
        sizes.clear()
        return real_log(step, metrics, tag=tag)

    trainer.sink.log = log
    try:
        trainer.train()
    finally:
        trainer.close()
    return steps


@pytest.mark.slow
def test_policy_forwards_per_step_and_the_fallback_guard(tmp_path):
    out = tmp_path / "runs.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run, steps in json.loads(out.read_text()).items():
        for s in steps:
            # Equal budget: the final trees hold every planned trajectory.
            assert s["trajectories"] + s["unspent"] == 24
            # The learner forwards every final token once, with grad; the predictor fits on those
            # hidden states, so no final-tree forward without grad is left.
            assert s["grad"] == s["final"]
            # No branch point with fewer than allocation.min_turns_left (2) of the 4 turns left.
            assert all(d <= 4 - 2 for d in s["branch_depths"])
            if s["fallback"]:  # treepo reads no prediction: no forward for the predictor at all
                assert s["no_grad"] == 0 and s["tag"].startswith("[treepo]")
            else:  # the prompts (all candidates) once, then the bare trees of the prompts given rollouts
                assert s["no_grad"] == s["all_roots"] + s["bare"] and s["tag"].startswith("[trace]")
                assert s["roots"] < s["bare"] < s["final"]
        # Step 0 has no previous fit to compare with (skill NaN): the predictor is not trusted before
        # its first held-out measurement, so steps 0 and 1 always run the fallback (treepo).
        assert [s["fallback"] for s in steps[:2]] == [1.0, 1.0]
        if run == "oracle":
            assert steps[1]["skill"] > 0 and steps[2]["fallback"] == 0.0
        if run == "worse":
            assert steps[1]["skill"] < 0 and steps[2]["fallback"] == 1.0


if __name__ == "__main__":
    worker(sys.argv[1])
