"""Stage 1 of TRACE-A: exact global root allocation (docs/design.md §3.2).

    maximise  sum_i V_root(v_i, m_i),  V_root(v, m) = 1 - v^m - (1-v)^m
    s.t.      sum_i m_i = budget,  m_i in {0} ∪ {2, ..., max_rollouts}

Algorithm (exact, batched, no host sync):

1. Relaxation. Treat the 0 -> 2 step as two half units of gain v(1-v) each.
   After it come the units g_3 = v(1-v) >= g_4 >= ... The unit gains of each
   prompt are then non-increasing, so the top-`budget` units over all prompts
   (one stable sort) give the optimum of the concave-envelope relaxation.
   Ties go by prompt index, so a prompt's tied units are contiguous and at
   most one prompt j ends on an odd half (c_j = 1). If none does, the
   relaxation is feasible, hence optimal.
2. Parity fix-up. Otherwise c' = c - e_j is the exact optimum for budget-1.
   Every unit it takes has gain >= λ = v_j(1-v_j), and every unit it leaves
   has gain <= λ. By an exchange argument, an optimum for `budget` is c' plus
   the better of two moves of net +1 unit:
     M1  one more unit for an active prompt below max_rollouts;
     M2  activate the best inactive prompt l (+2) and drop the cheapest tail
         unit of a prompt with c' >= 3 (-1).
   Proof sketch: write any optimum as c' plus per-prompt changes. Each added
   unit loses λ - gain >= 0 and each removed unit loses gain - λ >= 0 against
   a net +λ. A raised active prompt is an M1 sub-move with no larger loss.
   A shortened active prompt plus an activation is an M2 sub-move. If only
   activations and deactivations are left, the activations (>= 2 units
   each) need a deactivation to net +1. A deactivated prompt with c' >= 3
   gives M2. One with c' = 2 has its halves taken and its third unit (also
   v(1-v)) left, so its gain is exactly λ, and M1 on it loses nothing.
   (With max_rollouts = 2 every change is even, so no net +1 exists.)
   `tests/allocation` checks this against an exhaustive DP on many random
   and adversarial instances.

A larger minimum group, m_i in {0} ∪ {min_rollouts, ..., max_rollouts} (`min_rollouts` > 2:
the baselines' group size, so no group is smaller than theirs), is no longer a parity
fix-up away from the relaxation: the entry step 0 -> min_rollouts is a block. That case is
solved by an exact dynamic programme over (prompt, units spent), vectorised over the units
on the device, one loop step per prompt and a device-side backtrack (no host sync):
O(B * budget * max_rollouts) work, O(B * budget) memory. Its ties are broken towards
skipping the later prompt.

Defined edge cases: budget 0 gives all zeros. Budget 1, a negative budget,
or an odd budget with max_rollouts = 2 raise ValueError (no exact
allocation exists). With budget >= B * max_rollouts every prompt gets
max_rollouts, so the result sums to less than the budget. NaN, or v outside
[0, 1], raises ValueError.
"""

from __future__ import annotations

import torch

from trace_mega.kernels.allocation import root_relaxed_counts, root_unit_gains

__all__ = ["root_value", "allocate_roots"]


def root_value(v: torch.Tensor, m: torch.Tensor | int) -> torch.Tensor:
    """P(m rollouts at success rate v hold a success and a failure) = 1 - v^m - (1-v)^m, element-wise.

    m = 0 (the prompt is skipped) is defined as 0; the formula's -1 there has no meaning.
    m = 1 gives 0, as the formula does. Broadcasts `v` against `m`.
    """
    v = torch.as_tensor(v)
    v = v if v.is_floating_point() else v.to(torch.get_default_dtype())
    m = torch.as_tensor(m, device=v.device)
    val = 1.0 - v**m - (1.0 - v) ** m
    return torch.where(m == 0, torch.zeros_like(val), val)


def _check_v(v: torch.Tensor, name: str = "v") -> None:
    """Raise ValueError for NaN or values outside [0, 1] (one host sync)."""
    bad = torch.isnan(v) | (v < 0) | (v > 1)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{name} must lie in [0, 1] without NaN; {name}[{i}] = {float(v[i])}")


def _check_budget(budget: int, max_rollouts: int, capacity: int, min_rollouts: int = 2) -> None:
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if budget == 1:
        raise ValueError("budget 1 is infeasible: a prompt gets 0 or >= 2 rollouts (a lone rollout has no contrast)")
    if max_rollouts == 2 and budget % 2 == 1 and budget < capacity:
        raise ValueError(f"odd budget {budget} cannot be spent exactly with max_rollouts = 2 (every m_i is 0 or 2)")
    if min_rollouts > 2 and 0 < budget < capacity and not spendable(budget, min_rollouts, max_rollouts):
        raise ValueError(
            f"budget {budget} cannot be spent exactly with m_i in {{0}} ∪ {{{min_rollouts}..{max_rollouts}}}"
        )


def spendable(budget: int, min_rollouts: int, max_rollouts: int) -> bool:
    """Whether some number n of active prompts spends `budget` exactly: n * min <= budget <= n * max."""
    n = -(-budget // max_rollouts)  # the fewest prompts that can take it
    return budget == 0 or n * min_rollouts <= budget


def allocate_roots(
    v: torch.Tensor, budget: int | torch.Tensor, max_rollouts: int, *, check: bool = True, min_rollouts: int = 2
) -> torch.Tensor:
    """Exact maximiser m (LongTensor[B], on v's device) of sum_i root_value(v_i, m_i) (see the module doc).

    Args:
        v: (B,) predicted success probabilities in [0, 1].
        budget: total root rollouts M, a Python int or a 0-d integer tensor (an int when
            min_rollouts > 2: the programme's width is the budget).
        max_rollouts: M_max >= 2.
        min_rollouts: the smallest group, 2 <= min_rollouts <= max_rollouts (2: the paper's).
        check: validate v and a tensor budget. This reads values back to the
            host (one sync). Pass False on the GPU hot path: invalid input
            then gives unspecified output, and an infeasible tensor budget
            (1, or odd with max_rollouts = 2) spends budget - 1.

    Ties in the objective are broken by prompt index: lower indices win.
    """
    if max_rollouts < 2:
        raise ValueError(f"max_rollouts must be >= 2, got {max_rollouts}")
    if not 2 <= min_rollouts <= max_rollouts:
        raise ValueError(f"min_rollouts must lie in [2, max_rollouts = {max_rollouts}], got {min_rollouts}")
    if v.dim() != 1:
        raise ValueError(f"v must be 1-D (B,), got shape {tuple(v.shape)}")
    if min_rollouts > 2:
        if isinstance(budget, torch.Tensor):
            raise ValueError("min_rollouts > 2 takes the budget as a Python int")
        _check_budget(int(budget), max_rollouts, v.shape[0] * max_rollouts, min_rollouts)
        if check:
            _check_v(v)
        return _roots_dp(v, min(int(budget), v.shape[0] * max_rollouts), min_rollouts, max_rollouts)
    B = v.shape[0]
    capacity = B * max_rollouts
    if isinstance(budget, torch.Tensor):
        if budget.dim() != 0 or budget.is_floating_point():
            raise ValueError("a tensor budget must be a 0-d integer tensor")
        if check:
            _check_budget(int(budget), max_rollouts, capacity)
        bud = budget.to(device=v.device, dtype=torch.long)
    else:
        _check_budget(int(budget), max_rollouts, capacity)
        bud = torch.full((), int(budget), dtype=torch.long, device=v.device)  # a fill, not a host copy
    if check:
        _check_v(v)
    if B == 0:
        return torch.zeros(0, dtype=torch.long, device=v.device)
    bud = torch.clamp(bud, max=capacity)

    U = root_unit_gains(v, max_rollouts)  # (B, Mmax) float64, rows non-increasing
    c = root_relaxed_counts(U, bud)  # (B,)
    split = c == 1  # at most one prompt
    has_split = split.any()  # 0-d bool tensor, stays on device
    cp = c - split.long()  # optimum for budget - 1
    inf = torch.full((), torch.inf, dtype=torch.float64, device=v.device)
    a = U[:, 0]  # (B,) v(1-v)

    # M1: the best next unit of an active prompt below the cap. `max(dim=0)` returns the value
    # and its index as device tensors: indexing with a 0-d tensor would read it to the host.
    nxt = U.gather(1, cp.clamp(max=max_rollouts - 1)[:, None]).squeeze(1)
    d1, i1 = torch.where((cp >= 2) & (cp < max_rollouts), nxt, -inf).max(0)
    # M2: activate the best inactive prompt l with 2 units, drop the cheapest last unit of a prompt with c' >= 3.
    a_l, l = torch.where(cp == 0, a, -inf).max(0)
    last = U.gather(1, (cp - 1).clamp(min=0)[:, None]).squeeze(1)
    rem, i2 = torch.where(cp >= 3, last, inf).min(0)
    d2 = 2.0 * a_l - rem  # -inf when either side is missing
    use1 = (d1 >= d2).long()  # M1 on ties
    apply = (has_split & (torch.maximum(d1, d2) > -inf)).long()
    idx = torch.stack([i1, l, i2])
    delta_m = torch.stack([use1, 2 * (1 - use1), use1 - 1]) * apply
    return cp.index_add(0, idx, delta_m)


def _roots_dp(v: torch.Tensor, budget: int, min_rollouts: int, max_rollouts: int) -> torch.Tensor:
    """m (B,): the exact optimum over m_i in {0} ∪ {min..max} by DP over (prompt, units spent).

    best[b] is the best objective of the prompts so far spending exactly b units (-inf: none).
    Prompt i either takes nothing or m in {min..max}: new[b] = max(best[b], max_m best[b - m] + f_i(m)).
    """
    B, dev = v.shape[0], v.device
    choices = torch.arange(min_rollouts, max_rollouts + 1, device=dev)  # (C,)
    vals = root_value(v.to(torch.float64)[:, None], choices[None, :])  # (B, C)
    units = torch.arange(budget + 1, device=dev)
    src = units[:, None] - choices[None, :] + max_rollouts  # (M+1, C) into best padded by max_rollouts -inf
    pad = torch.full((max_rollouts,), -torch.inf, dtype=torch.float64, device=dev)
    best = torch.full((budget + 1,), -torch.inf, dtype=torch.float64, device=dev)
    best[0] = 0.0
    took = torch.zeros(B, budget + 1, dtype=torch.long, device=dev)  # m of prompt i on the best path to b
    for i in range(B):
        cand, c = (torch.cat([pad, best])[src] + vals[i]).max(1)  # (M+1,): prompt i active
        take = cand > best
        took[i] = torch.where(take, choices[c], 0)
        best = torch.where(take, cand, best)
    m = torch.zeros(B, dtype=torch.long, device=dev)
    left = torch.full((), budget, dtype=torch.long, device=dev)
    for i in range(B - 1, -1, -1):  # the backtrack, on the device
        m_i = took[i].gather(0, left.view(1))  # a 0-d index tensor would be read to the host
        m[i : i + 1] = m_i
        left = left - m_i[0]
    return m
