"""Predictor training samples from collected rollout trees (docs/design.md §3.1).

A node's target is the mean reward of its terminal descendants (a leaf's is
its reward). Samples are the roots (the prompt, H_0) and the intermediate
prefixes (non-root, non-terminal nodes, H_t); terminal states need no
prediction. The root/prefix mix is reported and can be re-weighted to a
configured prefix fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from trace_mega.rollout.tree import PackedTrees


@dataclass
class PredictorSamples:
    """Training samples laid on a packed batch."""

    node: torch.Tensor  # (S,) int64 global node ids in the packed batch
    target: torch.Tensor  # (S,) fp32 soft targets in [0, 1]
    weight: torch.Tensor  # (S,) fp32 sample weights (sum = S)
    is_root: torch.Tensor  # (S,) bool
    index: Optional[torch.Tensor] = None
    """(S,) int64 positions of these samples in the step's whole sample list when they are one
    data-parallel rank's share of it (`share`); None: they are the whole list."""
    total: Optional[int] = None
    """Samples in the whole list (all ranks' shares); None: S."""

    @property
    def num_total(self) -> int:
        return self.node.numel() if self.total is None else self.total

    @property
    def positions(self) -> torch.Tensor:
        """(S,) positions in the whole sample list."""
        return torch.arange(self.node.numel()) if self.index is None else self.index

    def share(self, packed: PackedTrees, trees: Sequence[int]) -> "PredictorSamples":
        """The samples on trees `trees` of `packed`, with node ids in `packed.select(trees)`."""
        idx, local = packed.nodes_in(trees, self.node)
        return PredictorSamples(
            node=local,
            target=self.target[idx],
            weight=self.weight[idx],
            is_root=self.is_root[idx],
            index=self.positions[idx],
            total=self.num_total,
        )

    @property
    def prefix_fraction(self) -> float:
        """Share of the (unweighted) samples that are prefixes rather than roots."""
        return float((~self.is_root).float().mean()) if self.node.numel() else 0.0


def predictor_samples(packed: PackedTrees, prefix_fraction: Optional[float] = None) -> PredictorSamples:
    """Roots and intermediate prefixes of `packed` with their descendant-mean targets.

    With `prefix_fraction` set, weights are chosen so that prefixes carry that
    share of the total weight (roots the rest); otherwise every sample weighs 1.
    """
    has_leaves = packed.node_leaf_count > 0
    is_root = packed.node_parent < 0
    is_leaf = torch.zeros_like(is_root)
    is_leaf[packed.leaf_nodes] = True
    keep = has_leaves & ~is_leaf
    node = torch.nonzero(keep).flatten()
    target = (packed.node_reward_sum[node] / packed.node_leaf_count[node].float()).float()
    root = is_root[node]
    weight = torch.ones(node.numel(), dtype=torch.float32)
    if prefix_fraction is not None and node.numel():
        n_root, n_pref = int(root.sum()), int((~root).sum())
        if n_root and n_pref:
            total = float(node.numel())
            weight[root] = (1.0 - prefix_fraction) * total / n_root
            weight[~root] = prefix_fraction * total / n_pref
    return PredictorSamples(node=node, target=target, weight=weight, is_root=root)
