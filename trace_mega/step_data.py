"""Per-step data helpers of the trainer: branchable prefixes, tree metrics, sharing trees across ranks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trace_mega.rollout.tree import PackedTrees, RolloutTree


@dataclass
class PrefixCandidates:
    """Every intermediate prefix H_{i,j,t} of the bare rollouts (SPEC §3.3), on their packed batch."""

    node: torch.Tensor  # (P,) global node ids in the packed bare trees
    r: torch.Tensor  # (P,) outcome (0/1) of the bare rollout through the prefix
    group: torch.Tensor  # (P,) prompt (tree) index
    local: list[tuple[int, int]]  # (tree index, local node id) of each candidate

    def branch_points(self, k: torch.Tensor) -> list[tuple[int, int, int]]:
        """(tree, node, k) for the prefixes given k > 0 continuations."""
        return [(t, n, int(c)) for (t, n), c in zip(self.local, k.tolist()) if c > 0]


def prefix_candidates(packed: PackedTrees) -> PrefixCandidates:
    """Non-root, non-terminal nodes of bare trees (each lies on exactly one bare rollout)."""
    is_leaf = torch.zeros(packed.num_nodes, dtype=torch.bool)
    is_leaf[packed.leaf_nodes] = True
    node = torch.nonzero((packed.node_parent >= 0) & ~is_leaf).flatten()
    # In a bare tree a non-root node has exactly one terminal descendant.
    r = packed.node_reward_sum[node] / packed.node_leaf_count[node].clamp(min=1)
    return PrefixCandidates(node=node, r=(r > 0.5).float(), group=packed.node_tree[node],
                            local=[packed.node_local[i] for i in node.tolist()])


def tree_metrics(packed: PackedTrees) -> dict[str, float]:
    """Effective ratio and contrast counts of a step's trees (binary rewards: success = reward > 0.5)."""
    leaf_success = (packed.leaf_reward > 0.5).float()
    tree_of_leaf = packed.node_tree[packed.leaf_nodes]
    n_trees = packed.num_trees
    succ = torch.zeros(n_trees).index_add(0, tree_of_leaf, leaf_success)
    count = torch.zeros(n_trees).index_add(0, tree_of_leaf, torch.ones_like(leaf_success))
    active = count > 0
    contrasted = active & (succ > 0) & (succ < count)
    # Branch points: nodes with >= 2 children; contrasted when their leaves disagree.
    children = torch.bincount(packed.node_parent[packed.node_parent >= 0], minlength=packed.num_nodes)
    branch = children >= 2
    mean = packed.node_reward_sum / packed.node_leaf_count.clamp(min=1)
    mixed = branch & (mean > 0) & (mean < 1)
    return {
        "alloc/effective_ratio": float(contrasted.sum() / active.sum().clamp(min=1)),
        "alloc/active_prompts": float(active.sum()),
        "alloc/contrasted_prompts": float(contrasted.sum()),
        "alloc/branch_points": float(branch.sum()),
        "alloc/contrasted_groups": float(mixed.sum()),
        "alloc/trajectories": float(packed.leaf_nodes.numel()),
        "reward/mean": float(packed.leaf_reward.mean()) if packed.leaf_nodes.numel() else 0.0,
        # Turns of each root-to-leaf trajectory (a continuation counts its shared prefix's turns too).
        "rollout/turns_per_episode": float(packed.node_depth[packed.leaf_nodes].float().mean())
        if packed.leaf_nodes.numel() else 0.0,
    }


def share_trees(trees: list[RolloutTree] | None, src: int = 0) -> list[RolloutTree]:
    """Broadcast rank `src`'s trees (records only, not the kept env states) to every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return trees
    payload = [[t.to_dict() for t in trees] if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src)
    if dist.get_rank() == src:
        return trees
    return [RolloutTree.from_dict(d) for d in payload[0]]
