"""Stage 2 of TRACE-A: exact local prefix expansion (docs/design.md §3.3), per prompt or with a global pool.

    maximise  sum_p V_pref(v_p, r_p, k_p),  V_pref = 1 - q_p^k,  q = r v + (1-r)(1-v)
    s.t.      sum_{p in g} k_p = budget[g]  for every group g   (pool="group", the paper's)
    or        sum_p k_p = sum_g budget[g]                        (pool="global", a cross-prompt pool)
    and       0 <= k_p <= max_per_prefix

q is the probability that a fresh continuation repeats the observed outcome.
The marginal gains q^k (1-q) do not increase with k, so the top `budget[g]`
units of each group are optimal. `kernels.allocation.segmented_threshold`
finds them for all groups at once, by a segmented bisection on the log gain.
There is no loop over groups, no unit table and no host sync.

Defined behaviour: when a group's caps sum to less than its budget, every
prefix gets its cap and the group spends less (the result then sums to
`min(budget[g], caps)`). A group with no prefixes spends nothing. Gain-0 units
(q = 1: the outcome cannot flip) are taken only after every positive unit of
the group. Ties go to the lower prefix index (the allocators break them at random by
permuting the prefixes first).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from trace_mega.allocation.root import _check_v
from trace_mega.kernels.allocation import segmented_threshold

__all__ = ["prefix_value", "flip_probability", "allocate_prefixes"]


def flip_probability(v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """1 - q: the chance that one continuation from a prefix of value v flips the observed outcome r."""
    r = r.to(v.dtype) if v.is_floating_point() else r.to(torch.get_default_dtype())
    return r * (1.0 - v) + (1.0 - r) * v


def prefix_value(v: torch.Tensor, r: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """V_pref = 1 - [r v + (1-r)(1-v)]^k element-wise (broadcasting): P(some of k continuations flips r)."""
    v = torch.as_tensor(v)
    v = v if v.is_floating_point() else v.to(torch.get_default_dtype())
    q = 1.0 - flip_probability(v, torch.as_tensor(r, device=v.device))
    return 1.0 - q ** torch.as_tensor(k, device=v.device)


def allocate_prefixes(
    v: torch.Tensor,
    r: torch.Tensor,
    group: torch.Tensor,
    budget: torch.Tensor | int,
    max_per_prefix: Optional[int] = None,
    *,
    pool: Literal["group", "global"] = "group",
    check: bool = True,
    backend: str = "torch",
    max_group_size: Optional[int] = None,
    taken: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact continuation counts K (LongTensor[P], on v's device); see the module doc.

    Args:
        v: (P,) predicted success from each candidate prefix, in [0, 1].
        r: (P,) observed 0/1 outcome of the bare rollout through the prefix.
        group: (P,) long, the prompt index of each prefix, in [0, G).
        budget: (G,) long continuation budget per prompt (m_g * N). With
            pool="global" it may also be an int total; a tensor is summed.
        max_per_prefix: cap on K per prefix (None: no cap).
        pool: "group" (per-prompt budgets) or "global" (one shared budget).
        check: validate v, r, group and budget (host syncs). Pass False on the GPU hot path.
        backend: "torch" (tensor program) or "triton" (kernels.allocation kernel).
        max_group_size: an upper bound on the prefixes of one group (e.g.
            max_rollouts * (turns - 1)). None reads the largest group back to the
            host once. With it, check=False runs with no host sync. Ignored
            with pool="global", where the one group is all P prefixes.
        taken: (P,) long continuations each prefix already has (a second pass that
            extends an earlier plan): the new units of p are its (taken_p + 1)-th, ...,
            and `max_per_prefix` bounds taken_p + new. Returns the new units only.
    """
    if v.dim() != 1 or r.shape != v.shape or group.shape != v.shape:
        raise ValueError(
            f"v, r, group must be 1-D of one shape; got {tuple(v.shape)}, {tuple(r.shape)}, {tuple(group.shape)}"
        )
    if max_per_prefix is not None and max_per_prefix < 0:
        raise ValueError(f"max_per_prefix must be >= 0 or None, got {max_per_prefix}")
    dev = v.device
    if pool == "global":
        total = budget.sum() if isinstance(budget, torch.Tensor) else torch.full((), int(budget), device=dev)
        bud = total.to(device=dev, dtype=torch.long).reshape(1)
        grp = torch.zeros_like(group, dtype=torch.long)
        max_group_size = v.numel()
    elif pool == "group":
        if not isinstance(budget, torch.Tensor) or budget.dim() != 1:
            raise ValueError("pool='group' needs budget as a 1-D tensor (G,) of per-prompt budgets")
        bud = budget.to(device=dev, dtype=torch.long)
        grp = group.to(device=dev, dtype=torch.long)
    else:
        raise ValueError(f"unknown pool {pool!r}; valid: group, global")
    if check:
        _check_v(v)
        if bool(((r != 0) & (r != 1)).any()):
            raise ValueError("r must be the 0/1 outcome of the bare rollout")
        if bool((bud < 0).any()):
            raise ValueError("budget must be >= 0")
        if grp.numel() and (int(grp.min()) < 0 or int(grp.max()) >= bud.numel()):
            raise ValueError(f"group indices must lie in [0, {bud.numel()}) (one budget per group)")
        if max_group_size is not None and grp.numel() and int(torch.bincount(grp).max()) > max_group_size:
            raise ValueError(f"a group has more than max_group_size = {max_group_size} prefixes")
    flip = flip_probability(v.to(torch.float64), r)  # (P,) 1 - q
    cap = bud[grp]  # (P,) a prefix never needs more than its group's budget
    if max_per_prefix is not None and taken is None:
        cap = torch.clamp(cap, max=max_per_prefix)
    elif max_per_prefix is not None:  # the cap bounds taken + new
        cap = torch.minimum(cap, torch.clamp(max_per_prefix - taken.to(dev, torch.long), min=0))
    return segmented_threshold(
        flip,
        grp,
        bud,
        cap,
        backend=backend,
        max_group_size=max_group_size,
        taken=None if taken is None else taken.to(dev, torch.long),
    )
