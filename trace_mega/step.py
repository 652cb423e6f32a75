"""`StepBatch`: the record of one trainer step (docs/step.md).

A step starts from its candidate prompts as root-only trees and ONE packed
layout of them. The layout is extended, never re-packed from scratch, when
the trees grow: after the bare rollouts (keeping the prompts that got any)
and after the continuations. The stages take their inputs as arguments and
return what they make; the trainer alone writes it here: predictions and
plans (TRACE-A, docs/design.md §3), the grown trees, the TRACE-C probe
values, the advantages and the policy update (its metrics and this rank's
hidden states, which the predictor's fit reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from trace_mega.evaluation import group_of
from trace_mega.rollout.tree import PackedTrees, RolloutTree, extend, pack

if TYPE_CHECKING:
    from trace_mega.envs.base import Task
    from trace_mega.learner.learner import PolicyUpdate
    from trace_mega.objective.advantages import Advantages


@dataclass
class PrefixCandidates:
    """Every intermediate prefix H_{i,j,t} of the bare rollouts (docs/design.md §3.3), on the step's layout."""

    node: torch.Tensor
    """(P,) global node ids in the layout of the bare trees."""
    r: torch.Tensor
    """(P,) outcome (0/1) of the bare rollout through the prefix."""
    group: torch.Tensor
    """(P,) candidate-prompt index of the prefix (indexes the per-prompt plan `StepBatch.rollouts`)."""
    local: list[tuple[int, int]]
    """(tree index in `StepBatch.trees`, local node id) of each candidate."""

    def branch_points(self, k: torch.Tensor) -> list[tuple[int, int, int]]:
        """(tree, node, k) for the prefixes given k > 0 continuations."""
        return [(t, n, int(c)) for (t, n), c in zip(self.local, k.tolist()) if c > 0]


@dataclass
class StepBatch:
    """One step's prompts, trees, layout and everything computed on them."""

    step: int
    tasks: list["Task"]
    """The B candidate prompts, in sampling order."""
    trees: list[RolloutTree]
    """The step's trees, one per prompt in `prompt_index` (all B until the rollout; then those given rollouts)."""
    prompt_index: torch.Tensor
    """(num_trees,) int64: which candidate prompt each tree belongs to."""
    packed: PackedTrees
    """THE layout of `trees` (docs/PACKING.md), extended as they grow."""
    v_root: Optional[torch.Tensor] = None
    """(B,) float64 predicted success of each candidate prompt (zeros for a predictor-free allocator)."""
    rollouts: Optional[torch.Tensor] = None
    """(B,) int64 m_i: bare rollouts per candidate prompt."""
    prefixes: Optional[PrefixCandidates] = None
    v_prefix: Optional[torch.Tensor] = None
    """(P,) float64 predicted success of each candidate prefix."""
    continuations: Optional[torch.Tensor] = None
    """(P,) int64 k: continuations branched from each candidate prefix."""
    root_continuations: Optional[torch.Tensor] = None
    """(B,) int64: fresh rollouts from each candidate prompt's root, the budget no prefix could take."""
    node_ell: Optional[torch.Tensor] = None
    """(N,) TRACE-C probe ℓ̄ at the boundary after each node of the final layout (credit enabled)."""
    advantages: Optional["Advantages"] = None
    """Per-token advantages and loss weights (and per-node A) on the final layout."""
    update: Optional["PolicyUpdate"] = None
    """The policy update on the final layout: its metrics and this data-parallel rank's hidden states."""

    @classmethod
    def from_prompts(cls, step: int, tasks: Sequence["Task"], prompt_ids: Sequence[list[int]]) -> "StepBatch":
        """Root-only trees of the candidate prompts and their layout."""
        trees = [RolloutTree(t.task_id, list(ids)) for t, ids in zip(tasks, prompt_ids)]
        return cls(step, list(tasks), trees, torch.arange(len(trees)), pack(trees))

    def eval_groups(self) -> Optional[list[str]]:
        """The eval group (`evaluation.group_of`: the benchmark, a level) of each tree's task, in tree order;
        None when some task names none."""
        groups = [group_of(self.tasks[i].meta, "") for i in self.prompt_index.tolist()]
        return groups if all(groups) else None

    def root_nodes(self) -> torch.Tensor:
        """(num_trees,) global ids of the roots (the prompts) in the layout."""
        return self.packed.tree_node_offset[:-1]

    def grow(self, trees: list[RolloutTree], keep: Optional[Sequence[int]] = None) -> None:
        """The step's trees after nodes were appended: `trees[i]` is tree i grown (the same objects
        or copies). With `keep`, only those trees stay (in that order); the layout is extended."""
        if len(trees) != len(self.trees):
            raise ValueError(f"grow: {len(trees)} trees for a step of {len(self.trees)}")
        keep = list(range(len(trees))) if keep is None else [int(i) for i in keep]
        base = self.packed if keep == list(range(len(trees))) else self.packed.select(keep)
        self.trees = [trees[i] for i in keep]
        self.prompt_index = self.prompt_index[torch.tensor(keep, dtype=torch.long)]
        self.packed = extend(base, self.trees)

    def prefix_candidates(self, max_depth: Optional[int] = None) -> PrefixCandidates:
        """Non-root, non-terminal nodes of the bare trees (each lies on exactly one bare rollout), at most
        `max_depth` turns deep (None: any; the trainer passes rollout.max_turns - allocation.min_turns_left)."""
        p = self.packed
        is_leaf = torch.zeros(p.num_nodes, dtype=torch.bool)
        is_leaf[p.leaf_nodes] = True
        shallow = p.node_depth <= (max_depth if max_depth is not None else p.num_nodes)
        node = torch.nonzero((p.node_parent >= 0) & ~is_leaf & shallow).flatten()
        # In a bare tree a non-root node has exactly one terminal descendant.
        r = p.node_reward_sum[node] / p.node_leaf_count[node].clamp(min=1)
        return PrefixCandidates(
            node=node,
            r=(r > 0.5).float(),
            group=self.prompt_index[p.node_tree[node]],
            local=[p.node_local[i] for i in node.tolist()],
        )

    def branch_points(self) -> list[tuple[int, int, int]]:
        """(tree, node, k) of the planned continuations: from prefixes, then from roots (node 0)."""
        points = self.prefixes.branch_points(self.continuations.cpu())
        if self.root_continuations is not None:
            extra = self.root_continuations.cpu()[self.prompt_index].tolist()  # per tree
            points += [(t, 0, int(e)) for t, e in enumerate(extra) if e > 0]
        return points
