"""Rollout allocators behind one name-keyed registry, all at exactly the same trajectory budget per step.

Each step spends exactly `trajectories_per_step = M + round(M * N)` generated trajectories
(M = root_rollouts_per_step, N = continuations_per_rollout):

* flat allocators (`uniform`, `pcl`) spend all of it as root rollouts in
  groups of `group_size` and plan no continuations;
* tree allocators (`treepo`, `trace`, `trace_global`) spend M root rollouts
  and round(M * N) continuations.

Budget a prompt cannot spend moves by one rule (tree allocators): a prompt whose bare
rollouts have no intermediate prefix (every one answered in one turn), or whose per-prefix
caps bind, leaves part of its continuation budget unspent. That part goes first to the
prefixes of the other prompts (`plan_prefixes`, a second pass that extends the per-prompt
plan: `trace` by the same exact marginal gains, `treepo` to the prefixes with the fewest
continuations, ties at random), and what no prefix can take becomes extra root rollouts
(`plan_root_continuations`: continuations branched from the root node, i.e. fresh
rollouts of the prompt, spread evenly over the active prompts, the remainder at random).
So `m.sum() + K.sum() + extra.sum() == trajectories_per_step` on every step.

`dapo` (trace_mega/allocation/dapo.py) spends it in rounds instead: `plan_refill` plans
another round of fresh groups once the previous round's rewards are known, and `plan_keep`
drops the groups without contrast; it generates at most `trajectories_per_step` (less when its
target batch fills first). Every other allocator has one round and keeps every prompt it served.

The interface is tensor-level, so the trainer and the simulator drive it the same way:
`plan_roots(v_root (B,), generator) -> m (B,)`,
`plan_prefixes(v_prefix (P,), r (P,), group (P,), m (B,), generator) -> K (P,)` and
`plan_root_continuations(m (B,), K (P,), generator) -> extra (B,)`.

Predictions are cleaned on their device first: NaN / ±inf become 0.5 (counted; `metrics()`
reports `alloc/invalid_predictions`), finite values are clamped to [0, 1]. Ties between equal
predictions are broken at random with the step's generator (the prompts / prefixes are
permuted by random keys before the exact solvers, whose own tie rule is the index), so equal
predictions spread continuations over all bare rollouts instead of the first one's earliest
prefixes. On an accelerator the keys come from a device generator seeded from the step's
(host) generator, so no step of a plan reads a device value back to the host.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from trace_mega.allocation.prefix import allocate_prefixes
from trace_mega.allocation.root import allocate_roots, root_value, spendable
from trace_mega.config import AllocationConfig
from trace_mega.registry import Registry

__all__ = [
    "Allocator",
    "ALLOCATORS",
    "build_allocator",
    "step_trajectories",
    "flat_groups",
    "split_budget",
    "random_keys",
    "clean_predictions",
]

log = logging.getLogger(__name__)

ALLOCATORS: Registry[type["Allocator"]] = Registry("allocator")

_WARNED: set[str] = set()


def step_trajectories(cfg: AllocationConfig) -> int:
    """M + round(M * N): the trajectories every allocator generates a step (dapo: at most)."""
    return cfg.root_rollouts_per_step + int(round(cfg.root_rollouts_per_step * cfg.continuations_per_rollout))


def random_keys(n: int, generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """(n,) float64 uniform keys on `device`, drawn from the host `generator` without a host sync.

    On CPU they come from `generator` itself; elsewhere from a device generator seeded with
    one draw of `generator` (a host-side op), so the plan is a function of the step's seed.
    """
    if device.type == "cpu":
        return torch.rand(n, generator=generator, dtype=torch.float64)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    if device.type == "meta":  # shapes only (the sync-freedom test)
        return torch.rand(n, dtype=torch.float64, device=device)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(n, generator=dev_gen, dtype=torch.float64, device=device)


def clean_predictions(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v with NaN / ±inf replaced by 0.5 and the rest clamped to [0, 1], number replaced (0-d, on v's device))."""
    bad = ~torch.isfinite(v)
    return torch.where(bad, torch.full_like(v, 0.5), v.clamp(0.0, 1.0)), bad.sum()


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


def _group_sizes(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(G,) members per group, as a scatter-add (torch.bincount sizes its output from the data: a sync)."""
    return torch.zeros(num_groups, dtype=torch.long, device=group.device).index_add_(0, group, torch.ones_like(group))


def _unpermute(values: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """`values` solved on the permuted items, back in the original order."""
    if perm is None:
        return values
    out = torch.empty_like(values)
    out[perm] = values
    return out


class Allocator:
    """Plans one step: root rollouts per candidate prompt, then continuations per candidate prefix."""

    name = "base"
    tree = False
    """Whether it spends continuations (tree rollouts) or puts the whole budget on roots."""
    uses_predictor: bool = False
    """Whether its plans read the predicted success values (else they may be all zeros)."""

    def __init__(
        self, cfg: AllocationConfig, *, check: bool = True, max_group_size: Optional[int] = None, min_trees: int = 1
    ) -> None:
        """`check=False` and `max_group_size` (most candidate prefixes of one prompt) make the
        trace solvers run with no host sync on the GPU hot path (see `allocate_prefixes`).
        `min_trees`: the fewest trees a step may keep (the trainer passes its data-parallel size:
        the learner gives every rank a tree); read by an allocator that drops served prompts (dapo)."""
        self.cfg = cfg
        self.check = check
        self.max_group_size = max_group_size
        self.min_trees = min_trees
        self.root_budget = cfg.root_rollouts_per_step
        self.trajectories_per_step = step_trajectories(cfg)
        self.continuation_budget = self.trajectories_per_step - self.root_budget
        self._invalid: list[torch.Tensor] = []
        if self.fewest_trees() < min_trees:
            raise ValueError(
                f"allocation.name={self.name}: a step may serve only {self.fewest_trees()} prompts "
                f"(allocation.root_rollouts_per_step={cfg.root_rollouts_per_step}, group_size={cfg.group_size}, "
                f"rollouts_per_prompt_max={cfg.rollouts_per_prompt_max}, prompts_per_step={cfg.prompts_per_step}), "
                f"fewer than the {min_trees} data-parallel ranks that each train on a tree; raise "
                "allocation.root_rollouts_per_step (or lower rollouts_per_prompt_max / group_size)"
            )
        if self.selection_is_a_no_op() and self.name not in _WARNED:
            _WARNED.add(self.name)
            log.warning(
                "allocation.name=%s: the budget serves every one of the %d candidate prompts, so its "
                "prompt selection is a no-op; raise allocation.prompts_per_step",
                self.name,
                cfg.prompts_per_step,
            )

    def selection_is_a_no_op(self) -> bool:
        """Whether the budget covers every candidate prompt (nothing is selected)."""
        return False

    def fewest_trees(self) -> int:
        """The fewest prompts (trees) a step's plan can serve; the trainer needs one per data-parallel rank."""
        return 1

    # --- predictions --------------------------------------------------------------
    def _clean(self, v: torch.Tensor) -> torch.Tensor:
        v, bad = clean_predictions(v)
        self._invalid.append(bad)
        return v

    def metrics(self) -> dict[str, float]:
        """`alloc/invalid_predictions`: NaN / inf predictions replaced since the last call (one host read)."""
        n = float(sum(int(t) for t in self._invalid))
        self._invalid.clear()
        return {"alloc/invalid_predictions": n}

    # --- the plan -----------------------------------------------------------------
    def plan_roots(self, v_root: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """m (B,) long: bare rollouts per candidate prompt."""
        raise NotImplementedError

    def plan_prefixes(
        self,
        v_prefix: torch.Tensor,
        r: torch.Tensor,
        group: torch.Tensor,
        m: torch.Tensor,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """K (P,) long: continuations per candidate prefix (prompt `group[p]`, bare outcome `r[p]`)."""
        return torch.zeros_like(group, dtype=torch.long)

    def plan_root_continuations(
        self, m: torch.Tensor, k: torch.Tensor, generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """extra (B,) long: fresh rollouts (continuations from the root) for the budget no prefix could take."""
        return torch.zeros_like(m)

    # --- rounds: an allocator that refills (dapo) plans more bare rollouts once it has seen outcomes ---
    def plan_refill(
        self, m: torch.Tensor, spread: torch.Tensor, generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """(B,) long: the next round's bare rollouts, on candidates given none yet, after the rounds so
        far gave `m` (B,) and each candidate's bare rewards spread `spread` (B,) float64 (max - min, 0
        for none); all zero: the step's bare rollouts are over. One round unless the allocator refills."""
        return torch.zeros_like(m)

    def plan_keep(self, m: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the candidates whose trees the step keeps after its rounds (default: every one
        given rollouts)."""
        return m > 0

    def prefix_budgets(self, m: torch.Tensor) -> torch.Tensor:
        """Continuation budget per prompt, b_i ≈ m_i * N, summing to `continuation_budget`."""
        return split_budget(m, self.cfg.continuations_per_rollout, self.continuation_budget)

    def without_predictor(self) -> "Allocator":
        """The predictor-free counterpart a step uses when the predictor did worse than a constant
        on the newest trees (`allocation.predictor_fallback`); itself for an allocator without one."""
        return self

    def _counterpart(self, name: str) -> "Allocator":
        """Allocator `name` on the same budget and solver options."""
        return ALLOCATORS.get(name)(
            dataclasses.replace(self.cfg, name=name),
            check=self.check,
            max_group_size=self.max_group_size,
            min_trees=self.min_trees,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(trajectories_per_step={self.trajectories_per_step})"


class _Flat(Allocator):
    """Flat rollouts (no tree): the whole trajectory budget as root groups of `group_size`."""

    def selection_is_a_no_op(self) -> bool:
        return self.trajectories_per_step // self.cfg.group_size >= self.cfg.prompts_per_step

    def fewest_trees(self) -> int:
        return min(self.cfg.prompts_per_step, self.trajectories_per_step // self.cfg.group_size)

    def _order(self, v_root: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        raise NotImplementedError

    def plan_roots(self, v_root, generator=None):
        return flat_groups(self._order(self._clean(v_root), generator), self.trajectories_per_step, self.cfg.group_size)


@ALLOCATORS.register("uniform")
class UniformAllocator(_Flat):
    """GRPO: prompts drawn uniformly at random, fixed group size, no branching."""

    name = "uniform"

    def _order(self, v_root, generator):
        return torch.argsort(random_keys(v_root.numel(), generator, v_root.device))


@ALLOCATORS.register("pcl")
class PCLAllocator(_Flat):
    """Prompt curriculum: the prompts whose predicted success is nearest 0.5, fixed group size (ties at random)."""

    name = "pcl"
    uses_predictor = True

    def without_predictor(self) -> Allocator:
        return self._counterpart("uniform")

    def _order(self, v_root, generator):
        dist = (v_root.to(torch.float64) - 0.5).abs()
        if generator is None:
            return torch.argsort(dist, stable=True)
        keys = random_keys(v_root.numel(), generator, v_root.device)
        by_key = torch.argsort(keys)
        return by_key[torch.argsort(dist[by_key], stable=True)]  # by distance, random among equals


class _Tree(Allocator):
    """Tree rollouts: M root rollouts, then round(M * N) continuations from their prefixes (or roots)."""

    tree = True

    def _local(self, v, r, group, m, generator) -> torch.Tensor:
        """The allocator's own per-prompt plan (K may sum to less than the budget)."""
        raise NotImplementedError

    def _extend(self, v, r, group, k, leftover) -> torch.Tensor:
        """New units (P,) giving `leftover` more continuations to any prefix with room, on top of `k`."""
        raise NotImplementedError

    def plan_prefixes(self, v_prefix, r, group, m, generator=None):
        v = self._clean(v_prefix)
        group = group.to(device=v.device, dtype=torch.long)
        perm = torch.argsort(random_keys(v.numel(), generator, v.device)) if generator is not None else None
        if perm is not None:  # random tie-breaking: the solvers break ties by index
            v, r, group = v[perm], r[perm], group[perm]
        k = self._local(v, r, group, m, generator)
        leftover = self.continuation_budget - k.sum()  # 0-d device tensor
        if v.numel():
            k = k + self._extend(v, r, group, k, leftover.clamp(min=0))
        return _unpermute(k, perm)

    def plan_root_continuations(self, m, k, generator=None):
        left = (self.continuation_budget - k.sum()).clamp(min=0)  # 0-d, on the device
        active = m > 0
        n = active.sum().clamp(min=1)
        keys = (
            random_keys(m.numel(), generator, m.device)
            if generator is not None
            else torch.arange(m.numel(), dtype=torch.float64, device=m.device)
        )
        keys = torch.where(active, keys, torch.full_like(keys, torch.inf))  # active prompts first
        rank = torch.empty_like(m)
        rank[torch.argsort(keys)] = torch.arange(m.numel(), device=m.device)
        extra = left // n + (rank < left % n).long()
        return torch.where(active, extra, torch.zeros_like(extra))


@ALLOCATORS.register("treepo")
class TreePOAllocator(_Tree):
    """TreePO: uniform roots (random prompts, fixed group size), branch points chosen uniformly at random.

    Within a prompt, its budget b is spread as evenly as possible over its n
    prefixes: each gets b // n, and b % n of them, drawn at random, get one
    more. Per-prefix caps then clip; what a prompt cannot spend goes to the
    prefixes of all prompts with the fewest continuations first (ties at random).
    """

    name = "treepo"

    def selection_is_a_no_op(self) -> bool:
        return self.root_budget // self.cfg.group_size >= self.cfg.prompts_per_step

    def fewest_trees(self) -> int:
        return min(self.cfg.prompts_per_step, self.root_budget // self.cfg.group_size)

    def plan_roots(self, v_root, generator=None):
        order = torch.argsort(random_keys(v_root.numel(), generator, v_root.device))
        return flat_groups(order, self.root_budget, self.cfg.group_size)

    def _local(self, v, r, group, m, generator):
        budget = self.prefix_budgets(m.to(v.device))  # (B,)
        P = group.numel()
        # The prefixes arrive in random order (plan_prefixes); rank them within their group.
        order = torch.argsort(group, stable=True)
        sizes = _group_sizes(group, budget.numel())
        start = torch.cumsum(sizes, 0) - sizes
        rank = torch.empty_like(order)
        rank[order] = torch.arange(P, device=group.device) - start[group[order]]
        n = sizes[group].clamp(min=1)
        b = budget[group]
        k = b // n + (rank < b % n).long()
        cap = self.cfg.continuations_per_prefix_max
        return k if cap is None else k.clamp(max=cap)

    def _extend(self, v, r, group, k, leftover):
        # Equal flip probabilities make the exact solver a water-filling: fewest continuations first.
        half = torch.full_like(v, 0.5)
        return allocate_prefixes(
            half,
            torch.ones_like(half),
            torch.zeros_like(group),
            leftover,
            self.cfg.continuations_per_prefix_max,
            pool="global",
            check=False,
            taken=k,
        )


@ALLOCATORS.register("trace")
class TraceAllocator(_Tree):
    """TRACE-A: exact root solver, then the exact per-prompt prefix solver (budget m_i * N per prompt).

    Budget a prompt cannot spend goes to the best remaining marginal units of all prefixes.
    """

    name = "trace"
    pool = "group"
    uses_predictor = True

    def __init__(self, cfg: AllocationConfig, **kwargs) -> None:
        M, Mmax, B = cfg.root_rollouts_per_step, cfg.rollouts_per_prompt_max, cfg.prompts_per_step
        if M > B * Mmax:
            raise ValueError(
                f"{self.name}: root budget {M} exceeds prompts_per_step * rollouts_per_prompt_max "
                f"= {B * Mmax}; it could not spend the equal budget"
            )
        if Mmax == 2 and M % 2:
            raise ValueError(f"{self.name}: odd root budget {M} cannot be spent with rollouts_per_prompt_max = 2")
        if not spendable(M, cfg.rollouts_per_prompt_min, Mmax):
            raise ValueError(
                f"{self.name}: root budget {M} cannot be spent in groups of "
                f"{cfg.rollouts_per_prompt_min}..{Mmax} (rollouts_per_prompt_min)"
            )
        super().__init__(cfg, **kwargs)

    def selection_is_a_no_op(self) -> bool:
        return self.root_budget >= self.cfg.prompts_per_step * self.cfg.rollouts_per_prompt_max

    def fewest_trees(self) -> int:
        return -(-self.root_budget // self.cfg.rollouts_per_prompt_max)  # every served prompt at the most

    def without_predictor(self) -> Allocator:
        return self._counterpart("treepo")

    def plan_roots(self, v_root, generator=None):
        v = self._clean(v_root)
        perm = torch.argsort(random_keys(v.numel(), generator, v.device)) if generator is not None else None
        v = v if perm is None else v[perm]
        if self.cfg.root_selection == "sampled":
            # Dynamic sampling keeps a drawn prompt when its group turns out contrasted; here a coin with the
            # predicted chance of that decides, and the accepted ones look alike to the solver (v = 1/2), so it
            # serves the first of them in the random order: prompts in proportion to their chance, not the top.
            accept = random_keys(v.numel(), generator, v.device) < root_value(v, self.cfg.group_size)
            v = torch.where(accept, 0.5, 0.0).to(v)
        # Exploration floor: the last n prompts of the (random) order get the smallest group (2 by
        # default) whatever their prediction, the solver spends the rest. Their v = 0 has gain 0 and
        # ties go to lower indices, so the solver gives them more only when every other prompt is at the cap.
        lo, hi = self.cfg.rollouts_per_prompt_min, self.cfg.rollouts_per_prompt_max
        n = min(int(self.cfg.exploration_fraction * self.root_budget) // lo, v.numel())
        while n and not spendable(self.root_budget - lo * n, lo, hi):  # e.g. a budget of 1 is infeasible
            n -= 1
        explored = torch.arange(v.numel(), device=v.device) >= v.numel() - n
        m = allocate_roots(
            torch.where(explored, torch.zeros_like(v), v),
            self.root_budget - lo * n,
            hi,
            check=self.check,
            min_rollouts=lo,
        )
        m = (m + lo * explored.long()).clamp(max=hi) if n else m
        return _unpermute(m, perm)

    def _local(self, v, r, group, m, generator):
        budget = self.prefix_budgets(m.to(v.device))
        return allocate_prefixes(
            v,
            r,
            group,
            budget,
            self.cfg.continuations_per_prefix_max,
            pool=self.pool,
            check=self.check,
            max_group_size=self.max_group_size,
        )

    def _extend(self, v, r, group, k, leftover):
        return allocate_prefixes(
            v,
            r,
            torch.zeros_like(group),
            leftover,
            self.cfg.continuations_per_prefix_max,
            pool="global",
            check=False,
            taken=k,
        )


@ALLOCATORS.register("trace_global")
class TraceGlobalAllocator(TraceAllocator):
    """TRACE-A roots with one continuation pool shared by all prompts (docs/design.md §3.3's cross-prompt option)."""

    name = "trace_global"
    pool = "global"


def build_allocator(cfg: AllocationConfig, **kwargs) -> Allocator:
    """The allocator named `cfg.name` (a ConfigError listing the valid names otherwise); kwargs go to `Allocator`."""
    return ALLOCATORS.check(cfg.name, "allocation.name")(cfg, **kwargs)
