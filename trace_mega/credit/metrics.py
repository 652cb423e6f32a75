"""Credit accuracy: how well TRACE-C's per-turn credit separates known-useful turns from the rest.

When the environment labels turns (`Env.turn_labels`, e.g. ``synthetic_search``:
useful = revealed a fact of the gold chain for the first time), each step logs

    credit/auc           ROC-AUC of the TD reward δ_k (useful = positive class)
    credit/auc_R         ROC-AUC of the look-ahead return R_k
    credit/delta_useful  mean δ over useful turns
    credit/delta_other   mean δ over the other turns
    credit/useful_turns, credit/other_turns   class sizes

over the turns that have a δ: every turn node followed by a boundary (not a final
answer, docs/credit.md). On trees, δ of a node is log(d_parent / d_node) and R the
mean over the leaves below of the per-path R (`credit.node_turn_credit`), exactly
what the advantages use.

ROC-AUC = P(score of a random useful turn > score of a random other turn), ties
counting one half (the Mann–Whitney U statistic / (n₊ n₋)), computed from average
ranks; NaN when a class is empty.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from trace_mega.config import CreditConfig
from trace_mega.credit.turn_credit import node_td_rewards, node_turn_credit
from trace_mega.rollout.tree import PackedTrees, RolloutTree

__all__ = ["roc_auc", "node_labels", "credit_accuracy", "env_credit_accuracy"]


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC-AUC of `scores` (M,) for boolean `labels` (M,), ties counted one half; NaN if a class is empty."""
    scores = scores.double().flatten()
    labels = labels.bool().flatten()
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Average ranks (1-based) of tied groups: rank sum of the positives gives U exactly.
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # 0-based rank of each distinct value's first member
    avg_rank = first.double() + (counts.double() + 1.0) / 2.0  # (U,)
    rank_sum = float(avg_rank[inverse][labels].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def node_labels(packed: PackedTrees, labels: Sequence[Sequence[Optional[bool]]]) -> torch.Tensor:
    """(N,) int8 per global node of `packed`: 1 useful, 0 not, -1 unlabelled (roots, None)."""
    out = torch.full((packed.num_nodes,), -1, dtype=torch.int8)
    for g, (ti, lid) in enumerate(packed.node_local):
        lab = labels[ti][lid]
        if lab is not None:
            out[g] = int(bool(lab))
    return out


def credit_accuracy(
    packed: PackedTrees,
    trees: Sequence[RolloutTree],
    node_ell: torch.Tensor,
    labels: Sequence[Sequence[Optional[bool]]],
    cfg: CreditConfig,
) -> dict[str, float]:
    """The `credit/*` metrics of one step (module docstring) from the probe's ℓ̄ (N,) and per-tree labels."""
    if len(labels) != len(trees) or any(len(lab) != len(t) for lab, t in zip(labels, trees)):
        raise ValueError("turn labels must give one entry per node of every tree")
    node_ell = node_ell.to(torch.float32)
    delta = node_td_rewards(packed, node_ell, cfg.epsilon)  # (N,)
    R = node_turn_credit(packed, node_ell, cfg.epsilon, cfg.gamma_td, cfg.lookahead_turns)  # (N,)
    lab = node_labels(packed, labels)
    scored = torch.isfinite(node_ell) & (packed.node_parent >= 0) & (lab >= 0)  # turns with a δ and a label
    y = lab[scored].bool()
    d, r = delta[scored], R[scored]
    mean = lambda x: float(x.mean()) if x.numel() else math.nan  # noqa: E731
    return {
        "credit/auc": roc_auc(d, y),
        "credit/auc_R": roc_auc(r, y),
        "credit/delta_useful": mean(d[y]),
        "credit/delta_other": mean(d[~y]),
        "credit/useful_turns": float(y.sum()),
        "credit/other_turns": float((~y).sum()),
    }


def env_credit_accuracy(
    env, packed: PackedTrees, trees: Sequence[RolloutTree], node_ell: Optional[torch.Tensor], cfg: CreditConfig
) -> dict[str, float]:
    """The trainer's hook: `credit_accuracy` when TRACE-C ran (`node_ell` not None) and `env` labels turns, else {}."""
    if node_ell is None:
        return {}
    labels = [env.turn_labels(t) for t in trees]
    if not labels or any(lab is None for lab in labels):
        return {}
    return credit_accuracy(packed, trees, node_ell, labels, cfg)
