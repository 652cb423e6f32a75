"""`trace-mega demo credit`: the summary arithmetic, and a shortened end-to-end run as a user runs it."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trace_mega.commands.credit_demo import METHODS, method_config, steps_to_threshold, summarize
from trace_mega.config import TrainConfig, load_yaml

ROOT = Path(__file__).resolve().parents[2]


def test_steps_to_threshold_trailing_window():
    r = [0.1, 0.2, 0.6, 0.7, 0.4, 0.9]
    assert steps_to_threshold(r, 0.5, 1) == 3
    assert steps_to_threshold(r, 0.5, 2) == 4  # (0.6 + 0.7) / 2 at step 4; (0.2 + 0.6) / 2 < .5 at step 3
    assert steps_to_threshold(r, 0.65, 2) == 6  # (0.4 + 0.9) / 2
    assert steps_to_threshold(r, 0.95, 1) is None


def test_summary_counts_censored_runs_and_means_over_seeds():
    def rows(rewards, turns, auc=None):
        return [
            {"step": i, "reward/mean": r, "rollout/turns_per_episode": t, **({"credit/auc": auc} if auc else {})}
            for i, (r, t) in enumerate(zip(rewards, turns))
        ]

    runs = {
        "grpo": [rows([0.0, 0.6, 0.6], [1, 2, 3]), rows([0.0, 0.0, 0.0], [1, 1, 1])],
        "grpo+credit": [rows([0.6, 0.6, 0.6], [2, 2, 2], auc=0.8), rows([0.6, 0.0, 0.6], [2, 2, 2], auc=0.6)],
    }
    table = summarize(runs, steps=3, threshold=0.5, window=1)
    assert table["grpo"]["steps_to_threshold_per_seed"] == [2, None]
    assert table["grpo"]["steps_to_threshold"] == (2 + 4) / 2  # never reached: counts steps + 1
    assert table["grpo"]["seeds_reaching_threshold"] == 1
    assert table["grpo+credit"]["steps_to_threshold"] == 1.0
    assert table["grpo"]["reward_last10"] == pytest.approx((1.2 / 3 + 0.0) / 2)
    assert table["grpo"]["turns_per_episode_last10"] == pytest.approx((2 + 1) / 2)
    assert table["grpo+credit"]["credit_auc_mean"] == pytest.approx(0.7)
    assert table["grpo+credit"]["credit_auc_last10"] == pytest.approx(0.7)
    assert math.isnan(table["grpo"]["credit_auc_mean"])  # no probe without credit


def test_methods_differ_only_in_their_switches():
    base = load_yaml(TrainConfig, ROOT / "configs" / "credit_demo.yaml")
    cfgs = {m: method_config(base, m, 2, "/ckpt", Path("/out")) for m in METHODS}
    assert {m: (c.allocation.name, c.advantage.name, c.credit.enabled) for m, c in cfgs.items()} == {
        "grpo": ("uniform", "grpo", False),
        "grpo+credit": ("uniform", "grpo", True),
        "tree": ("treepo", "tree", False),
        "tree+credit": ("treepo", "tree", True),
    }
    for c in cfgs.values():
        assert c.seed == 2 and c.model.hf_checkpoint == "/ckpt" and c.steps == base.steps
        assert (c.allocation.root_rollouts_per_step, c.allocation.continuations_per_rollout) == (
            base.allocation.root_rollouts_per_step,
            base.allocation.continuations_per_rollout,
        )  # equal budget


def test_demo_composes_credit_by_the_auto_rule():
    # tree+credit must keep its branch-point contrasts (broadcast), grpo+credit runs the paper's anchored rule.
    from trace_mega.objective.advantages import resolve_mixing

    base = load_yaml(TrainConfig, ROOT / "configs" / "credit_demo.yaml")
    assert base.credit.mixing == "auto"
    mix = {
        m: resolve_mixing(c.credit, c.advantage)
        for m in ("grpo+credit", "tree+credit")
        for c in [method_config(base, m, 0, "/ckpt", Path("/out"))]
    }
    assert mix == {"grpo+credit": "anchored", "tree+credit": "broadcast"}


@pytest.mark.slow
def test_credit_demo_end_to_end(tmp_path):
    pre = yaml.safe_load((ROOT / "configs" / "pretrain_search.yaml").read_text())
    pre.update(steps=3, episodes_per_step=4, num_stores=16, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "pre.yaml").write_text(yaml.safe_dump(pre))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "demo",
        "credit",
        "--out",
        str(tmp_path / "out"),
        "--pretrain-config",
        str(tmp_path / "pre.yaml"),
        "--seeds",
        "0",
        "--methods",
        "grpo,tree+credit",
        "steps=2",
        "allocation.prompts_per_step=4",
        "allocation.root_rollouts_per_step=4",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["methods"]) == {"grpo", "tree+credit"}
    for row in report["methods"].values():
        assert {"steps_to_threshold", "reward_last10", "turns_per_episode_last10", "credit_auc_mean"} <= set(row)
    rows = [
        json.loads(l) for l in (tmp_path / "out" / "tree+credit" / "seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 2 and all("credit/auc" in r and "credit/delta_useful" in r for r in rows)
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000 and "| tree+credit |" in proc.stdout


def test_turns_per_episode_counts_shared_prefix_turns():
    from trace_mega.rollout.tree import Node, RolloutTree, pack
    from trace_mega.telemetry import tree_metrics

    t = RolloutTree("t", [1, 2])
    a = t.add_node(0, Node(0, [3], [1], [0.0]))
    t.add_path(a, [Node(0, [4], [1], [0.0], kind="final")], 1.0)  # 2 turns
    t.add_path(a, [Node(0, [5], [1], [0.0]), Node(0, [6], [1], [0.0], kind="final")], 0.0)  # 3 turns
    t.add_path(0, [Node(0, [7], [1], [0.0], kind="final")], 0.0)  # 1 turn
    assert tree_metrics(pack([t]))["rollout/turns_per_episode"] == pytest.approx(2.0)


def test_demo_lookahead_credits_every_hop_of_the_longest_chain():
    # A 3-hop chain followed in order (hop, hop, value), then a repeat and an irrelevant lookup, scored by an
    # oracle reader (gold likelihood 1/10 until the value shows, 1 after): δ ties the hops with the useless
    # turns, while the demo's look-ahead R gives every hop a share of the value reveal.
    from trace_mega.credit.metrics import credit_accuracy
    from trace_mega.envs.synthetic_search import SyntheticSearchEnv
    from trace_mega.rollout.tree import Node, RolloutTree, pack

    base = load_yaml(TrainConfig, ROOT / "configs" / "credit_demo.yaml")
    longest = max(SyntheticSearchEnv(num_tasks=1, num_test_tasks=0).hops)
    t = RolloutTree("t", [1, 2], gold_answer="7")
    kinds = ["tool"] * (longest + 2) + ["final"]
    t.add_path(0, [Node(0, [5], [1], [0.0], kind=k) for k in kinds], 1.0)
    labels = [[None] + [True] * longest + [False, False, False]]
    # ℓ̄ after the root and the hops, then after the value, the repeat and the irrelevant turn; none after the answer
    ell = torch.tensor([math.log(0.1)] * longest + [0.0, 0.0, 0.0, float("nan")])
    m = credit_accuracy(pack([t]), [t], ell, labels, dataclasses.replace(base.credit, enabled=True))
    assert m["credit/auc_R"] == 1.0
    assert m["credit/auc"] == pytest.approx((2 * 1.0 + 2 * (longest - 1) * 0.5) / (2 * longest))
    short = dataclasses.replace(base.credit, enabled=True, lookahead_turns=longest - 1)
    assert credit_accuracy(pack([t]), [t], ell, labels, short)["credit/auc_R"] < 1.0  # the first hop gets 0
