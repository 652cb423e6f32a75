"""The learner-level mismatch check, in-process (test_mismatch.py, DP = 1) and as a torchrun worker (DP = 2).

`step_and_whole(learner)`: engine log-probs 0.4 nats of noise off the learner's, one NaN; one
`Learner.train_step` (2 mini-batches, several micro-batches per rank); returns the step's metrics
and the mismatch metrics of the whole batch computed at once from the same log-probs.
`normalised_steps(learner)`: the same batch (no NaN) with and without `loss.rollout_is_batch_normalize`,
in 1 and in 2 mini-batches.

As a worker, argv: OUT_JSON; rank 0 writes {"dp": .., "step": .., "whole": .., "normalised": ..}.
"""

import dataclasses
import json
import math
import sys

import torch

from trace_mega.config import AdvantageConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trace_mega.objective.advantages import compute_advantages
from trace_mega.objective.losses import LossBatch
from trace_mega.objective.mismatch import correction_weights, mismatch_metrics, rollout_correction
from trace_mega.rollout.tree import Node, RolloutTree, pack

VOCAB = 61


def train_config() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(vocab_size=VOCAB),
        parallel=ParallelConfig(device="cpu", micro_batch_tokens=48),
        optim=OptimConfig(lr=1e-8, clip_grad_norm=0.0, mini_batches_per_step=2),
        loss=LossConfig(rollout_is="token", rollout_mask="token"),
    )


def agent_trees(n: int = 8) -> list[RolloutTree]:
    g = torch.Generator().manual_seed(0)
    tok = lambda k: torch.randint(1, VOCAB, (k,), generator=g).tolist()  # noqa: E731
    turn = lambda gen, obs: Node(0, tok(gen + obs), [1] * gen + [0] * obs, [0.0] * (gen + obs))  # noqa: E731
    out = []
    for i in range(n):
        t = RolloutTree(f"p{i}", tok(4 + i % 3))
        a = t.add_node(0, turn(3 + i % 2, 2))
        t.add_path(a, [turn(2, 3), turn(4, 0)], 1.0)
        t.add_path(a, [turn(3, 0)], float(i % 2))
        out.append(t)
    return out


def _engine_batch(learner, nan: bool):
    """(trees, packed, the learner's old log-probs (T,)): engine log-probs 0.4 nats off the learner's on the
    trees' nodes, one NaN on a loss token with `nan`."""
    trees = agent_trees()
    packed = pack(trees)
    old = learner.old_logprobs(packed)
    g = torch.Generator().manual_seed(5)
    eng = old + 0.4 * torch.randn(packed.num_tokens, generator=g)
    if nan:
        eng[int(packed.loss_mask.nonzero()[2])] = math.nan
    for gi, (ti, lid) in enumerate(packed.node_local):  # the engine's log-probs onto the trees' nodes
        node = trees[ti].nodes[lid]
        s, e = int(packed.node_start[gi]), int(packed.node_end[gi])
        node.logprobs = [float(x) if mk else 0.0 for x, mk in zip(eng[s:e].tolist(), node.loss_mask)]
    return trees, pack(trees), old


def normalised_steps(learner) -> tuple[list[tuple[dict[str, float], dict[str, float]]], float]:
    """([(a step's metrics, the same step's with `loss.rollout_is_batch_normalize`)] for 1 and 2 mini-batches
    (several micro-batches per rank), the whole batch's mean IS weight)."""
    trees, packed, old = _engine_batch(learner, nan=False)
    adv = compute_advantages(packed, trees, AdvantageConfig(name="tree"))
    cfg, pairs = learner.cfg, []
    try:
        for minis in (1, 2):
            learner.cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, mini_batches_per_step=minis))
            plain = learner.train_step(packed, adv).metrics
            loss = dataclasses.replace(cfg.loss, rollout_is_batch_normalize=True)
            learner.cfg = dataclasses.replace(learner.cfg, loss=loss)
            pairs.append((plain, learner.train_step(packed, adv).metrics))
    finally:
        learner.cfg = cfg
    _, met = correction_weights(old, packed.behaviour_logprobs, LossBatch(packed, adv.advantages), cfg.loss)
    return pairs, (met["is_norm_sum"] / met["is_norm_count"]).item()


def step_and_whole(learner) -> tuple[dict[str, float], dict[str, float], float]:
    """(the step's metrics, the whole batch's mismatch metrics, the loss tokens' count)."""
    trees, packed, old = _engine_batch(learner, nan=True)
    step = learner.train_step(packed, compute_advantages(packed, trees, AdvantageConfig(name="tree"))).metrics
    batch = LossBatch(packed, torch.zeros(packed.num_tokens))
    _, sums = rollout_correction(old, packed.behaviour_logprobs, old, batch, learner.cfg.loss)
    return step, mismatch_metrics({k: v.item() for k, v in sums.items()}), float(packed.loss_mask.sum())


def main() -> None:
    from trace_mega.learner.learner import Learner
    from trace_mega.learner.parallel import destroy_parallel

    learner = Learner(train_config())
    step, whole, tokens = step_and_whole(learner)
    normalised = normalised_steps(learner)
    if learner.groups.rank == 0:
        with open(sys.argv[1], "w") as f:
            res = {"dp": learner.groups.dp_size, "step": step, "whole": whole, "tokens": tokens}
            json.dump(res | {"normalised": normalised}, f)
    destroy_parallel()  # a live process group at interpreter exit can abort the process


if __name__ == "__main__":
    main()
