"""Rollout allocators behind one name-keyed registry, all at the same trajectory budget per step.

Each step spends `trajectories_per_step = M + round(M * N)` generated trajectories
(M = root_rollouts_per_step, N = continuations_per_rollout):

* flat allocators (`uniform`, `pcl`) spend all of it as root rollouts in
  groups of `group_size` and plan no continuations;
* tree allocators (`treepo`, `trace`, `trace_global`) spend M root rollouts
  and round(M * N) continuations branched from prefixes of those rollouts.

The interface is tensor-level, so the trainer and the simulator drive it the same way:
`plan_roots(v_root (B,), generator) -> m (B,)` and
`plan_prefixes(v_prefix (P,), r (P,), group (P,), m (B,), generator) -> K (P,)`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from trace_mega.allocation.prefix import allocate_prefixes
from trace_mega.allocation.root import allocate_roots
from trace_mega.config import AllocationConfig
from trace_mega.registry import Registry

__all__ = ["Allocator", "ALLOCATORS", "build_allocator", "flat_groups", "split_budget"]

ALLOCATORS: Registry[type["Allocator"]] = Registry("allocator")


def flat_groups(order: torch.Tensor, total: int, group_size: int) -> torch.Tensor:
    """Spend `total` rollouts on the first prompts of `order` (a permutation of 0..B-1), `group_size` each.

    n = min(B, total // group_size) prompts are active. The total // group_size
    remainder is spread one rollout at a time over the first active prompts,
    so the sum is exactly `total`. If B is too small, groups grow beyond
    group_size. If total < group_size, one prompt gets everything.
    """
    B = order.numel()
    m = torch.zeros(B, dtype=torch.long, device=order.device)
    if total < 2 or B == 0:
        return m
    n = max(1, min(B, total // group_size))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(B, device=order.device)
    base, extra = divmod(total, n)
    return torch.where(rank < n, base + (rank < extra).long(), m)


def split_budget(m: torch.Tensor, per_rollout: float, total: int) -> torch.Tensor:
    """Per-prompt continuation budgets b_i ≈ m_i * N, as integers summing to `total` (when any m_i > 0).

    Floors first. The rest goes one unit each to active prompts in order of
    the largest fractional part, ties to the lower index.
    """
    exact = m.to(torch.float64) * per_rollout  # (B,)
    b = torch.floor(exact).long()
    rest = total - b.sum()
    frac = torch.where(m > 0, exact - b, torch.full_like(exact, -1.0))
    order = torch.argsort(-frac, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(m.numel(), device=m.device)
    return b + ((rank < rest) & (m > 0)).long()


class Allocator:
    """Plans one step: root rollouts per candidate prompt, then continuations per candidate prefix."""

    name = "base"
    tree = False
    """Whether it spends continuations (tree rollouts) or puts the whole budget on roots."""
    uses_predictor: bool = False
    """Whether its plans read the predicted success values (else they may be all zeros)."""

    def __init__(self, cfg: AllocationConfig, *, check: bool = True, max_group_size: Optional[int] = None) -> None:
        """`check=False` and `max_group_size` (most candidate prefixes of one prompt) make the
        trace solvers run with no host sync on the GPU hot path (see `allocate_prefixes`)."""
        self.cfg = cfg
        self.check = check
        self.max_group_size = max_group_size
        self.root_budget = cfg.root_rollouts_per_step
        self.continuation_budget = int(round(cfg.root_rollouts_per_step * cfg.continuations_per_rollout))
        self.trajectories_per_step = self.root_budget + self.continuation_budget

    def plan_roots(self, v_root: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """m (B,) long: bare rollouts per candidate prompt."""
        raise NotImplementedError

    def plan_prefixes(self, v_prefix: torch.Tensor, r: torch.Tensor, group: torch.Tensor, m: torch.Tensor,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """K (P,) long: continuations per candidate prefix (prompt `group[p]`, bare outcome `r[p]`).

        A prompt whose bare rollouts have no intermediate prefix (single-turn
        trajectories) cannot spend its per-prompt budget. `trace_global` moves
        that budget to other prompts, and the per-prompt allocators spend less.
        """
        return torch.zeros_like(group, dtype=torch.long)

    def prefix_budgets(self, m: torch.Tensor) -> torch.Tensor:
        """Continuation budget per prompt, b_i ≈ m_i * N, summing to `continuation_budget`."""
        return split_budget(m, self.cfg.continuations_per_rollout, self.continuation_budget)

    def without_predictor(self) -> "Allocator":
        """The predictor-free counterpart a step uses when the predictor did worse than a constant
        on the newest trees (`allocation.predictor_fallback`); itself for an allocator without one."""
        return self

    def _counterpart(self, name: str) -> "Allocator":
        """Allocator `name` on the same budget and solver options."""
        return ALLOCATORS.get(name)(dataclasses.replace(self.cfg, name=name), check=self.check,
                                    max_group_size=self.max_group_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(trajectories_per_step={self.trajectories_per_step})"


class _Flat(Allocator):
    """Flat rollouts (no tree): the whole trajectory budget as root groups of `group_size`."""

    def _order(self, v_root: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        raise NotImplementedError

    def plan_roots(self, v_root, generator=None):
        return flat_groups(self._order(v_root, generator), self.trajectories_per_step, self.cfg.group_size)


@ALLOCATORS.register("uniform")
class UniformAllocator(_Flat):
    """GRPO: prompts drawn uniformly at random, fixed group size, no branching."""

    name = "uniform"

    def _order(self, v_root, generator):
        return torch.randperm(v_root.numel(), generator=generator).to(v_root.device)


@ALLOCATORS.register("pcl")
class PCLAllocator(_Flat):
    """Prompt curriculum: the prompts whose predicted success is nearest 0.5, fixed group size."""

    name = "pcl"
    uses_predictor = True

    def without_predictor(self) -> Allocator:
        return self._counterpart("uniform")

    def _order(self, v_root, generator):
        return torch.argsort((v_root.to(torch.float64) - 0.5).abs(), stable=True)


class _Tree(Allocator):
    """Tree rollouts: M root rollouts, then round(M * N) continuations from their prefixes."""

    tree = True


@ALLOCATORS.register("treepo")
class TreePOAllocator(_Tree):
    """TreePO: uniform roots (random prompts, fixed group size), branch points chosen uniformly at random.

    Within a prompt, its budget b is spread as evenly as possible over its n
    prefixes: each gets b // n, and b % n of them, drawn at random, get one
    more. Per-prefix caps then clip, and the group spends less.
    """

    name = "treepo"

    def plan_roots(self, v_root, generator=None):
        order = torch.randperm(v_root.numel(), generator=generator).to(v_root.device)
        return flat_groups(order, self.root_budget, self.cfg.group_size)

    def plan_prefixes(self, v_prefix, r, group, m, generator=None):
        budget = self.prefix_budgets(m)  # (B,)
        P = group.numel()
        keys = torch.rand(P, generator=generator, dtype=torch.float64).to(group.device)
        order = torch.argsort(keys)
        order = order[torch.argsort(group[order], stable=True)]  # by group, random inside
        sizes = torch.bincount(group, minlength=budget.numel())
        start = torch.cumsum(sizes, 0) - sizes
        rank = torch.empty_like(order)
        rank[order] = torch.arange(P, device=group.device) - start[group[order]]
        n = sizes[group].clamp(min=1)
        b = budget[group]
        k = b // n + (rank < b % n).long()
        cap = self.cfg.continuations_per_prefix_max
        return k if cap is None else k.clamp(max=cap)


@ALLOCATORS.register("trace")
class TraceAllocator(_Tree):
    """TRACE-A: exact root solver, then the exact per-prompt prefix solver (budget m_i * N per prompt)."""

    name = "trace"
    pool = "group"
    uses_predictor = True

    def __init__(self, cfg: AllocationConfig, **kwargs) -> None:
        super().__init__(cfg, **kwargs)
        M, Mmax, B = cfg.root_rollouts_per_step, cfg.rollouts_per_prompt_max, cfg.prompts_per_step
        if M > B * Mmax:
            raise ValueError(f"{self.name}: root budget {M} exceeds prompts_per_step * rollouts_per_prompt_max "
                             f"= {B * Mmax}; it could not spend the equal budget")
        if Mmax == 2 and M % 2:
            raise ValueError(f"{self.name}: odd root budget {M} cannot be spent with rollouts_per_prompt_max = 2")

    def without_predictor(self) -> Allocator:
        return self._counterpart("treepo")

    def plan_roots(self, v_root, generator=None):
        return allocate_roots(v_root, self.root_budget, self.cfg.rollouts_per_prompt_max, check=self.check)

    def plan_prefixes(self, v_prefix, r, group, m, generator=None):
        budget = self.prefix_budgets(m)
        return allocate_prefixes(v_prefix, r, group, budget, self.cfg.continuations_per_prefix_max, pool=self.pool,
                                 check=self.check, max_group_size=self.max_group_size)


@ALLOCATORS.register("trace_global")
class TraceGlobalAllocator(TraceAllocator):
    """TRACE-A roots with one continuation pool shared by all prompts (SPEC §3.3's cross-prompt option)."""

    name = "trace_global"
    pool = "global"


def build_allocator(cfg: AllocationConfig, **kwargs) -> Allocator:
    """The allocator named `cfg.name` (KeyError listing the valid names otherwise); kwargs go to `Allocator`."""
    return ALLOCATORS.get(cfg.name)(cfg, **kwargs)
