"""Device-side hot paths of the TRACE-A allocation solvers.

Two primitives carry all the per-element work of `trace_mega.allocation`:

* `root_relaxed_counts(v, budget, max_rollouts)` — the unit-gain table of the
  root problem and its top-`budget` selection (the Lagrangian / concave-envelope
  relaxation). One stable sort over `B * max_rollouts` units, no host sync.
* `segmented_threshold(flip, group, budget, cap)` — per-group exact top-`budget[g]`
  selection over the geometric marginal gains `q^k (1 - q)`, q = 1 - flip, of the prefix
  problem, by bisection on a per-group log-threshold plus a deterministic
  (prefix-index order) fill of the units that tie at the threshold. O(P) memory,
  no unit table, no host sync, any budget size.

Both exist as pure tensor programs (the reference, and the path used on CPU).
`segmented_threshold` also has a Triton kernel (`backend="triton"`): one
program per group keeps that group's threshold in registers and runs the
whole bisection loop in a single launch. The tensor program instead needs
about 6 launches per iteration and 64 iterations. The kernel is tested under
TRITON_INTERPRET=1 against the tensor program (identical integer output).

Which one is faster: this project has no GPU to measure on yet, so the
default is `backend="torch"` everywhere and the kernel is opt-in. On CPU,
Triton runs only through the interpreter, which is about 1e4 times slower,
so "torch" is the only real choice there. `benchmarks/bench_allocation_kernel.py`
times both when CUDA is present. Switch the default only after that
measurement.

The root problem's hot part is one sort plus a few gathers. A hand-written
kernel would have to re-implement a global sort, so it stays a tensor program.
"""
from __future__ import annotations

import torch

try:  # Triton is optional at import time (CPU installs may lack it).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

__all__ = ["root_unit_gains", "root_relaxed_counts", "segmented_threshold", "segmented_fill",
           "prefix_log_gains", "THRESHOLD_ITERS"]

THRESHOLD_ITERS = 64
"""Bisection steps of `segmented_threshold`; the bracket shrinks to range / 2**64."""


def root_unit_gains(v: torch.Tensor, max_rollouts: int) -> torch.Tensor:
    """Per-unit marginal gains of V_root, shape (B, max_rollouts), float64.

    Column 0 and 1 are the two halves of the 0 -> 2 step (v(1-v) each);
    column k >= 2 is g_{k+1} = f(k+1) - f(k) = v(1-v)(v^(k-1) + (1-v)^(k-1)).
    The rows are non-increasing in exact arithmetic. A running minimum
    enforces that in floating point (it changes values only by rounding
    noise), so the top units of each row are always a prefix of the row.
    """
    v = v.to(torch.float64)
    a = v * (1.0 - v)  # (B,)
    e = torch.arange(max_rollouts, device=v.device, dtype=torch.float64) - 1.0  # exponent k-1
    tail = a[:, None] * (v[:, None] ** e + (1.0 - v[:, None]) ** e)  # (B, Mmax)
    tail[:, : min(3, max_rollouts)] = a[:, None]  # halves of 0->2 and g_3 are exactly v(1-v)
    return torch.cummin(tail, dim=1).values


def root_relaxed_counts(units: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Counts c_i of the top-`budget` units of a (B, Mmax) non-increasing gain table.

    Ties are broken by prompt index, then unit position (stable sort on the
    row-major flat index). So the units of one prompt that tie are
    contiguous, and at most one prompt ends with an odd half (c_i = 1).
    `budget` is a 0-d long tensor on the table's device (no host sync).
    """
    B, Mmax = units.shape
    order = torch.sort(units.reshape(-1), descending=True, stable=True).indices  # (B*Mmax,)
    taken = (torch.arange(B * Mmax, device=units.device) < budget).long()
    return torch.zeros(B, dtype=torch.long, device=units.device).index_add_(0, order // Mmax, taken)


def prefix_log_gains(flip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Bq), float64, with log gain of unit k = A - k * Bq: A = log(flip), Bq = -log(1 - flip).

    Taking the flip probability 1 - q directly keeps tiny flips (q within
    rounding of 1) positive instead of rounding them to a gain of 0.
    """
    flip = flip.to(torch.float64)
    return torch.log(flip), -torch.log1p(-flip)


def _counts(A: torch.Tensor, Bq: torch.Tensor, cap: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """Units k < cap with log gain A - k Bq >= T (finite T), as float64 (P,).

    flip = 0 (A = -inf) has no positive unit: T > A gives 0. flip = 1 (Bq = inf) gives
    (A - T) / inf = 0, so one unit.
    """
    k = torch.floor((A - T) / Bq) + 1.0
    k = torch.where(T > A, torch.zeros_like(k), k)
    return torch.minimum(k, cap)


def _positive_capacity(A: torch.Tensor, Bq: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Units with a positive gain per prefix: cap, or min(1, cap) at flip = 1, or 0 at flip = 0."""
    one = torch.minimum(cap, torch.ones_like(cap))
    return torch.where(A == -torch.inf, torch.zeros_like(cap), torch.where(Bq == torch.inf, one, cap))


def segmented_fill(want: torch.Tensor, avail: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Give each group g `want[g]` units from its members' `avail`, in member-index order.

    Member p gets clamp(want[g] - (avail of the earlier members of g), 0, avail[p]).
    This is the deterministic tie fill. Members may come in any group order.
    """
    perm = torch.argsort(group, stable=True)  # members grouped, index order inside a group
    g_sorted = group[perm]
    a_sorted = avail[perm]
    totals = torch.zeros(num_groups, dtype=avail.dtype, device=avail.device).index_add_(0, group, avail)
    before_group = torch.cumsum(totals, 0) - totals  # (G,) exclusive
    excl = torch.cumsum(a_sorted, 0) - a_sorted - before_group[g_sorted]  # (P,) earlier members of my group
    give_sorted = torch.clamp(want[g_sorted] - excl, min=0)
    give_sorted = torch.minimum(give_sorted, a_sorted)
    out = torch.empty_like(avail)
    out[perm] = give_sorted
    return out


def segmented_threshold(flip: torch.Tensor, group: torch.Tensor, budget: torch.Tensor, cap: torch.Tensor,
                        backend: str = "torch", iters: int = THRESHOLD_ITERS) -> torch.Tensor:
    """Exact per-group top-`budget[g]` selection over units with gains q_p^k (1 - q_p), k < cap_p.

    Args: flip (P,) = 1 - q in [0, 1]; group (P,) long in [0, G); budget (G,) long >= 0;
    cap (P,) long >= 0 (the most units prefix p may take). Returns k (P,) long
    with sum over each group = min(budget[g], sum of caps). Units with gain 0
    (flip = 0, or k >= 1 at flip = 1) are used only after every positive unit of
    the group is taken. Ties (gains inside the final bisection bracket, which
    is 2**-64 of the log range wide) are filled in prefix-index order.
    """
    G = budget.numel()
    A, Bq = prefix_log_gains(flip)  # (P,)
    capf = cap.to(torch.float64)
    budf = budget.to(torch.float64)
    pos_cap = _positive_capacity(A, Bq, capf)  # (P,)
    # Log gain of each prefix's last positive unit; the global minimum brackets every threshold.
    last = torch.where(pos_cap > 1, A - (pos_cap - 1) * Bq, A)
    last = torch.where(pos_cap > 0, last, torch.zeros_like(last))
    lo0 = (torch.amin(last) if last.numel() else torch.zeros((), dtype=torch.float64, device=flip.device)) - 1.0
    if backend == "triton":
        lo, hi = _bisect_triton(A, Bq, capf, group, budf, lo0, iters)
    elif backend == "torch":
        lo, hi = _bisect_torch(A, Bq, capf, group, budf, lo0, iters)
    else:
        raise ValueError(f"unknown backend {backend!r}; valid: torch, triton")
    k_hi = _counts(A, Bq, capf, hi[group])  # strictly above the threshold: always taken
    k_lo = _counts(A, Bq, capf, lo[group])  # at or above: the bracket's ties
    c_hi = torch.zeros(G, dtype=torch.float64, device=flip.device).index_add_(0, group, k_hi)
    k = k_hi + segmented_fill(budf - c_hi, k_lo - k_hi, group, G)
    # Whatever budget remains goes to zero-gain units, again in index order.
    c = torch.zeros(G, dtype=torch.float64, device=flip.device).index_add_(0, group, k)
    k = k + segmented_fill(budf - c, capf - pos_cap, group, G)
    return k.long()


def _bisect_torch(A, Bq, capf, group, budf, lo0, iters):
    """Per-group bisection on the log threshold T: keeps C(lo) >= budget > C(hi) (when reachable)."""
    G = budf.numel()
    lo = lo0.expand(G).clone()  # (G,)
    hi = torch.ones(G, dtype=torch.float64, device=A.device)  # log gains are <= 0 < 1: C(hi) = 0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        cnt = torch.zeros(G, dtype=torch.float64, device=A.device).index_add_(0, group, _counts(A, Bq, capf, mid[group]))
        ge = cnt >= budf
        lo = torch.where(ge, mid, lo)
        hi = torch.where(ge, hi, mid)
    return lo, hi


if triton is not None:

    @triton.jit
    def _bisect_kernel(A_ptr, Bq_ptr, cap_ptr, start_ptr, budget_ptr, lo0_ptr, lo_ptr, hi_ptr,
                       ITERS: tl.constexpr, BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
        """One program per group: bisection over its contiguous member segment [start[g], start[g+1])."""
        g = tl.program_id(0)
        s = tl.load(start_ptr + g)
        e = tl.load(start_ptr + g + 1)
        bud = tl.load(budget_ptr + g)
        lo = tl.load(lo0_ptr)  # float64 scalar; the loop-carried values keep its type
        hi = lo * 0.0 + 1.0
        for _ in range(ITERS):
            mid = 0.5 * (lo + hi)
            total = lo * 0.0
            for c in range(MAX_CHUNKS):
                offs = s + c * BLOCK + tl.arange(0, BLOCK)
                m = offs < e
                a = tl.load(A_ptr + offs, mask=m, other=-float("inf"))
                b = tl.load(Bq_ptr + offs, mask=m, other=1.0)
                cp = tl.load(cap_ptr + offs, mask=m, other=0.0)
                k = tl.floor((a - mid) / b) + 1.0
                k = tl.where(mid > a, 0.0, k)
                k = tl.minimum(k, cp)
                total += tl.sum(k, axis=0)
            ge = total >= bud
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid)
        tl.store(lo_ptr + g, lo)
        tl.store(hi_ptr + g, hi)


def _bisect_triton(A, Bq, capf, group, budf, lo0, iters, block: int = 64):
    """Triton version of `_bisect_torch`: members sorted into segments, one program per group.

    The chunk count per segment is a compile-time constant. Computing it reads
    the largest group size back to the host, which is the one sync of this path.
    """
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    G = budf.numel()
    perm = torch.argsort(group, stable=True)
    sizes = torch.bincount(group, minlength=G)
    start = torch.zeros(G + 1, dtype=torch.int64, device=A.device)
    start[1:] = torch.cumsum(sizes, 0)
    max_chunks = max(1, triton.cdiv(int(sizes.max()) if G else 1, block))
    lo = torch.empty(G, dtype=torch.float64, device=A.device)
    hi = torch.empty(G, dtype=torch.float64, device=A.device)
    if G:
        _bisect_kernel[(G,)](A[perm].contiguous(), Bq[perm].contiguous(), capf[perm].contiguous(), start,
                             budf.contiguous(), lo0.reshape(1), lo, hi, ITERS=iters, BLOCK=block, MAX_CHUNKS=max_chunks)
    return lo, hi
