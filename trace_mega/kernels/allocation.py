"""Device-side hot paths of the TRACE-A allocation solvers.

Two primitives carry all the per-element work of `trace_mega.allocation`:

* `root_unit_gains(v, max_rollouts)` and `root_relaxed_counts(units, budget)`:
  the unit-gain table of the root problem and its top-`budget` selection (the
  concave-envelope relaxation). One stable sort over `B * max_rollouts` units,
  no host sync.
* `segmented_threshold(flip, group, budget, cap)`: per-group exact top-`budget[g]`
  selection over the geometric marginal gains `q^k (1 - q)`, q = 1 - flip, of the
  prefix problem. It bisects on a per-group log-threshold, then fills the units
  that tie at the threshold in prefix-index order, so the result is
  deterministic. The prefixes are laid out once as a padded (G, W) table (W =
  the largest group). Each bisection step is then a few dense row ops with a
  row sum: no gather, no atomics, no unit table, any budget size. The
  starting bracket is per group (the b-th best first unit), so few steps
  touch the full table. W is a shape, so it is read back to the host once
  unless the caller passes `max_group_size` (then there is no host sync).

Both exist as pure tensor programs (the path used on CPU, and the ground truth of
the Triton kernel; the exact DP references of the whole problems are in
`allocation_ref.py`).
`segmented_threshold` also has a Triton kernel (`backend="triton"`): one
program per group keeps that group's threshold in registers and runs the
whole bisection loop in a single launch. The tensor program instead needs
about 7 launches per step, for 64 steps on an accelerator (on CPU it drops
settled groups and stops early). The kernel is tested under
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

__all__ = [
    "root_unit_gains",
    "root_relaxed_counts",
    "segmented_threshold",
    "dense_layout",
    "prefix_log_gains",
    "THRESHOLD_ITERS",
]

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
    B = v.shape[0]
    a = v * (1.0 - v)  # (B,)
    tail = a[:, None].expand(B, max_rollouts).clone()  # (B, Mmax): halves of 0->2 and g_3 are exactly v(1-v)
    if max_rollouts > 3:
        # Column k >= 3 needs v^(k-1) and (1-v)^(k-1): running products are cheaper than pow.
        pw = torch.cumprod(v[:, None].expand(B, max_rollouts - 2), dim=1)[:, 1:]  # v^2 .. v^(Mmax-2)
        qw = torch.cumprod((1.0 - v)[:, None].expand(B, max_rollouts - 2), dim=1)[:, 1:]
        tail[:, 3:] = a[:, None] * (pw + qw)
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
    rank = torch.empty_like(order)
    rank[order] = torch.arange(B * Mmax, device=units.device)  # inverse permutation: a scatter, not an atomic add
    return (rank.view(B, Mmax) < budget).sum(1)


def prefix_log_gains(flip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Bq), float64, with log gain of unit k = A - k * Bq: A = log(flip), Bq = -log(1 - flip).

    Taking the flip probability 1 - q directly keeps tiny flips (q within
    rounding of 1) positive instead of rounding them to a gain of 0.
    """
    flip = flip.to(torch.float64)
    # log1p(-flip) underflows to -0.0 for subnormal flips; a positive floor keeps the division's sign.
    Bq = torch.clamp(-torch.log1p(-flip), min=torch.finfo(torch.float64).tiny)
    # flip in {0, 1} has at most one positive unit (the count cap handles it), so any finite slope works.
    return torch.log(flip), torch.where((flip == 0) | (flip == 1), torch.ones_like(Bq), Bq)


def _counts(A: torch.Tensor, Bq: torch.Tensor, cap: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """Positive units k < cap with log gain A - k Bq >= T: clamp(floor((A - T) / Bq) + 1, 0, cap), float64.

    `cap` is the positive-unit capacity. flip = 0 and the padding (A = -inf) count 0.
    """
    return torch.minimum(torch.clamp(torch.floor((A - T) / Bq) + 1.0, min=0.0), cap)


def dense_layout(
    group: torch.Tensor, num_groups: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(perm, slot, W): prefix perm[i] sits at flat slot slot[i] of a (G, W) table, rows in index order.

    W = the largest group (read back to the host) unless `width` is given.
    """
    perm = torch.argsort(group, stable=True)  # by group, index order inside a group
    g_sorted = group[perm]
    # A scatter-add, not torch.bincount: bincount sizes its output from the data (a host sync).
    sizes = torch.zeros(num_groups, dtype=torch.long, device=group.device).index_add_(0, group, torch.ones_like(group))
    start = torch.cumsum(sizes, 0) - sizes
    W = int(sizes.max()) if width is None and group.numel() else (width or 1)
    W = max(W, 1)
    slot = g_sorted * W + torch.arange(group.numel(), device=group.device) - start[g_sorted]
    return perm, slot, W


def _scatter(values: torch.Tensor, perm: torch.Tensor, slot: torch.Tensor, G: int, W: int, fill: float):
    out = torch.full((G * W,), fill, dtype=torch.float64, device=values.device)
    out[slot] = values[perm].to(torch.float64)
    return out.view(G, W)


def _row_fill(want: torch.Tensor, avail: torch.Tensor) -> torch.Tensor:
    """Row g gives want[g] units from avail[g, :] left to right: clamp(want - earlier, 0, avail) (G, W)."""
    earlier = torch.cumsum(avail, 1) - avail
    return torch.minimum(torch.clamp(want[:, None] - earlier, min=0.0), avail)


def segmented_threshold(
    flip: torch.Tensor,
    group: torch.Tensor,
    budget: torch.Tensor,
    cap: torch.Tensor,
    backend: str = "torch",
    iters: int = THRESHOLD_ITERS,
    max_group_size: int | None = None,
    taken: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact per-group top-`budget[g]` selection over units with gains q_p^k (1 - q_p), k < cap_p.

    Args: flip (P,) = 1 - q in [0, 1]; group (P,) long in [0, G); budget (G,) long >= 0;
    cap (P,) long >= 0 (the most units prefix p may take); max_group_size: an
    upper bound on the prefixes per group (None: computed, one host sync);
    taken (P,) long >= 0: units prefix p already has (None: 0). Its new units are then
    k = taken_p, taken_p + 1, ... with gains q^k (1 - q), and `cap` counts new units only.
    Returns k (P,) long with sum over each group = min(budget[g], sum of caps).
    Units with gain 0 (flip = 0, or k >= 1 at flip = 1) are used only after
    every positive unit of the group is taken. Ties (gains inside the final
    bisection bracket, 2**-64 of the log range wide) are filled in
    prefix-index order.
    """
    G = budget.numel()
    P = flip.numel()
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; valid: torch, triton")
    perm, slot, W = dense_layout(group, G, max_group_size)
    A, Bq = prefix_log_gains(flip)  # (P,)
    # flip = 1 has one positive unit (k = 0); after `taken` units none is left.
    one_left = torch.ones_like(A)
    if taken is not None:
        A = A - taken.to(A) * Bq  # log gain of unit taken_p: the first new one
        one_left = torch.clamp(1.0 - taken.to(A), min=0.0)
    A, Bq = _scatter(A, perm, slot, G, W, -torch.inf), _scatter(Bq, perm, slot, G, W, 1.0)  # (G, W)
    capf = _scatter(cap, perm, slot, G, W, 0.0)
    budf = budget.to(torch.float64)
    flip_t = _scatter(flip, perm, slot, G, W, 0.0)
    one_left = _scatter(one_left, perm, slot, G, W, 0.0)
    pos_cap = torch.where(
        flip_t == 0, torch.zeros_like(capf), torch.where(flip_t == 1, torch.minimum(capf, one_left), capf)
    )  # positive units (G, W)
    lo, hi = _initial_bracket(A, Bq, pos_cap, budget)
    if backend == "triton":
        lo, hi = _bisect_triton(A, Bq, pos_cap, budf, lo, hi, iters)
    else:
        lo, hi = _bisect_torch(A, Bq, pos_cap, budf, lo, hi, iters)
    k_hi = _counts(A, Bq, pos_cap, hi[:, None])  # (G, W) strictly above the threshold: always taken
    k_lo = _counts(A, Bq, pos_cap, lo[:, None])  # at or above: the bracket's ties
    k = k_hi + _row_fill(budf - k_hi.sum(1), k_lo - k_hi)
    k = k + _row_fill(budf - k.sum(1), capf - pos_cap)  # what remains goes to gain-0 units
    out = torch.empty(P, dtype=torch.long, device=flip.device)
    out[perm] = k.reshape(-1)[slot].long()
    return out


def _initial_bracket(A, Bq, pos_cap, budget):
    """Per-group (lo, hi) with C(lo) >= budget > C(hi) whenever the budget is reachable.

    hi sits just above the best first unit, so C(hi) = 0. lo is the b-th best
    first unit (b = budget[g]): the b best prefixes' first units alone reach
    the budget. If fewer than b prefixes have a positive unit, lo falls back to
    below every unit of the table. Narrow brackets save most of the early,
    full-table bisection steps.
    """
    G, W = A.shape
    top = torch.sort(A, dim=1, descending=True).values  # (G, W), -inf last
    last = torch.where(pos_cap > 0, A - torch.clamp(pos_cap - 1, min=0) * Bq, torch.zeros_like(A))
    floor = torch.amin(last) - 1.0 if A.numel() else torch.zeros((), dtype=torch.float64, device=A.device)
    b_th = top.gather(1, (budget.clamp(min=1, max=W) - 1)[:, None]).squeeze(1)  # (G,)
    ok = (budget >= 1) & (budget <= W) & (b_th > -torch.inf)
    lo = torch.where(ok, b_th, floor)
    hi = torch.nextafter(torch.clamp(top[:, 0], min=floor), torch.full_like(lo, torch.inf))
    return lo, torch.maximum(hi, torch.nextafter(lo, torch.full_like(lo, torch.inf)))


def _bisect_torch(A, Bq, capf, budf, lo, hi, iters):
    """Row-wise bisection on the log threshold T, keeping C(lo) >= budget > C(hi) when reachable.

    A group is settled once C(lo) <= budget: all its units >= lo are then taken
    and the bracket's width no longer matters. On CPU, where a read-back costs
    nothing, settled groups are dropped from the table every 2 steps and the
    loop stops when none is left. On an accelerator all `iters` steps run on
    the full table, with no host sync.
    """
    G = budf.numel()
    if A.device.type != "cpu":
        for _ in range(iters):
            mid = 0.5 * (lo + hi)
            ge = _counts(A, Bq, capf, mid[:, None]).sum(1) >= budf
            lo, hi = torch.where(ge, mid, lo), torch.where(ge, hi, mid)
        return lo, hi
    act = torch.arange(G)  # groups still open
    a, b, c, bud, l, h = A, Bq, capf, budf, lo.clone(), hi.clone()
    c_lo = _counts(a, b, c, l[:, None]).sum(1)
    for it in range(iters):
        mid = 0.5 * (l + h)
        cnt = _counts(a, b, c, mid[:, None]).sum(1)
        ge = cnt >= bud
        l, h, c_lo = torch.where(ge, mid, l), torch.where(ge, h, mid), torch.where(ge, cnt, c_lo)
        if it % 2 == 1 or it == iters - 1:
            lo[act], hi[act] = l, h
            keep = c_lo > bud
            if not bool(keep.any()):
                break
            act, a, b, c, bud, l, h, c_lo = (x[keep] for x in (act, a, b, c, bud, l, h, c_lo))
    return lo, hi


if triton is not None:

    @triton.jit
    def _bisect_kernel(
        A_ptr,
        Bq_ptr,
        cap_ptr,
        budget_ptr,
        lo_ptr,
        hi_ptr,
        W,
        ITERS: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
    ):
        """One program per group: the whole bisection over its row of the (G, W) table, bracket in place."""
        g = tl.program_id(0)
        bud = tl.load(budget_ptr + g)
        lo = tl.load(lo_ptr + g)  # float64 scalars
        hi = tl.load(hi_ptr + g)
        for _ in range(ITERS):
            mid = 0.5 * (lo + hi)
            total = lo * 0.0
            for c in range(CHUNKS):
                cols = c * BLOCK + tl.arange(0, BLOCK)
                m = cols < W
                offs = g * W + cols
                a = tl.load(A_ptr + offs, mask=m, other=-float("inf"))
                b = tl.load(Bq_ptr + offs, mask=m, other=1.0)
                cp = tl.load(cap_ptr + offs, mask=m, other=0.0)
                k = tl.minimum(tl.maximum(tl.floor((a - mid) / b) + 1.0, 0.0), cp)
                total += tl.sum(k, axis=0)
            ge = total >= bud
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid)
        tl.store(lo_ptr + g, lo)
        tl.store(hi_ptr + g, hi)


def _bisect_triton(A, Bq, capf, budf, lo, hi, iters, block: int = 64):
    """Triton version of `_bisect_torch` on the same (G, W) table: one program per group, one launch."""
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    G, W = A.shape
    lo, hi = lo.contiguous().clone(), hi.contiguous().clone()
    if G:
        _bisect_kernel[(G,)](
            A.contiguous(),
            Bq.contiguous(),
            capf.contiguous(),
            budf.contiguous(),
            lo,
            hi,
            W,
            ITERS=iters,
            BLOCK=block,
            CHUNKS=triton.cdiv(W, block),
        )
    return lo, hi
