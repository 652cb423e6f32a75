"""Reference of `allocation`: the allocation problems solved exactly by dynamic programmes, and plain-Python greedies.

The ground truth that `allocation.py`'s primitives, and the solvers built on them
(`trace_mega.allocation`: `allocate_roots`, `allocate_prefixes`), are checked
against (tests/kernels/test_allocation.py, tests/allocation/) and timed against
(benchmarks/bench_allocation.py). They work on host NumPy / Python data and loop
over prompts by design: obviously right, not fast.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "root_objective",
    "prefix_objective",
    "roots_dp",
    "prefixes_dp",
    "roots_greedy_python",
    "prefixes_greedy_python",
]


def root_objective(v: Sequence[float], m: Sequence[int]) -> float:
    """sum_i V_root(v_i, m_i) in float64 (m = 0 counts 0)."""
    v = np.asarray(v, dtype=np.float64)
    m = np.asarray(m, dtype=np.int64)
    val = 1.0 - v**m - (1.0 - v) ** m
    return float(np.where(m == 0, 0.0, val).sum())


def prefix_objective(v: Sequence[float], r: Sequence[int], k: Sequence[int]) -> float:
    """sum_p V_pref(v_p, r_p, k_p) in float64."""
    v = np.asarray(v, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    q = r * v + (1.0 - r) * (1.0 - v)
    return float((1.0 - q ** np.asarray(k, dtype=np.int64)).sum())


def roots_dp(
    v: Sequence[float], budget: int, max_rollouts: int, min_rollouts: int = 2
) -> tuple[Optional[np.ndarray], float]:
    """Exact root allocation by DP over (prompt, units spent), m_i in {0} ∪ {min_rollouts..max_rollouts}.
    Returns (m, objective); m None when infeasible.

    The budget is clamped to B * max_rollouts, the same rule as `allocate_roots`.
    Cost O(B * budget * max_rollouts) time, O(B * budget) bytes.
    """
    v = np.asarray(v, dtype=np.float64)
    B = len(v)
    M = min(int(budget), B * max_rollouts)
    choices = np.array([0] + list(range(min_rollouts, max_rollouts + 1)))  # the feasible m
    dp = np.full(M + 1, -np.inf)
    dp[0] = 0.0
    arg = np.zeros((B, M + 1), dtype=np.uint8)
    cols = max_rollouts - choices  # window column j holds dp[b + j - max_rollouts], i.e. m = max_rollouts - j
    for i in range(B):
        vals = 1.0 - v[i] ** choices - (1.0 - v[i]) ** choices
        vals[0] = 0.0
        padded = np.concatenate([np.full(max_rollouts, -np.inf), dp])
        windows = np.lib.stride_tricks.sliding_window_view(padded, max_rollouts + 1)  # (M+1, Mmax+1) view
        cand = windows[:, cols] + vals  # (M+1, |choices|): dp[b - m] + f(m)
        best = np.argmax(cand, axis=1)
        dp = cand[np.arange(M + 1), best]
        arg[i] = choices[best]
    if not np.isfinite(dp[M]):
        return None, -np.inf
    m_out = np.zeros(B, dtype=np.int64)
    b = M
    for i in range(B - 1, -1, -1):
        m_out[i] = arg[i, b]
        b -= m_out[i]
    return m_out, float(dp[M])


def prefixes_dp(v, r, group, budget, max_per_prefix: Optional[int] = None) -> tuple[np.ndarray, float]:
    """Exact per-group prefix allocation by DP over (prefix, units spent). Returns (k, objective).

    Spends min(budget[g], caps of g) per group (values never decrease in k, so
    spending more never hurts). Cost O(P * budget^2) time.
    """
    v = np.asarray(v, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    group = np.asarray(group, dtype=np.int64)
    q = r * v + (1.0 - r) * (1.0 - v)
    k_out = np.zeros(len(v), dtype=np.int64)
    total = 0.0
    for g, bud in enumerate(np.asarray(budget, dtype=np.int64)):
        members = np.nonzero(group == g)[0]
        if len(members) == 0 or bud == 0:
            continue
        caps = [int(bud) if max_per_prefix is None else min(int(bud), max_per_prefix) for _ in members]
        W = min(int(bud), sum(caps))
        dp = np.full(W + 1, -np.inf)
        dp[0] = 0.0
        args = []
        for p, cap in zip(members, caps):
            ks = np.arange(min(cap, W) + 1)
            vals = 1.0 - q[p] ** ks
            # new[b] = max_k dp[b - k] + vals[k]
            table = np.full((len(ks), W + 1), -np.inf)
            for k in ks:
                table[k, k:] = dp[: W + 1 - k] + vals[k]
            best_k = np.argmax(table, axis=0)
            dp = table[best_k, np.arange(W + 1)]
            args.append(best_k)
        total += dp[W]
        b = W
        for p, best_k in zip(members[::-1], args[::-1]):
            k_out[p] = best_k[b]
            b -= k_out[p]
    return k_out, float(total)


def roots_greedy_python(v: Sequence[float], budget: int, max_rollouts: int) -> list[int]:
    """The same exact algorithm as `allocate_roots` in plain Python (sort of units, parity fix-up).

    A timing baseline. It is also exact, so tests hold it to the DP as well.
    """
    v = [float(x) for x in v]
    B = len(v)
    M = min(int(budget), B * max_rollouts)
    units = []  # (-gain, prompt, position)
    for i, x in enumerate(v):
        a = x * (1.0 - x)
        prev = a
        for pos in range(max_rollouts):
            g = a if pos < 3 else min(prev, a * (x ** (pos - 1) + (1.0 - x) ** (pos - 1)))
            prev = g
            units.append((-g, i, pos))
    units.sort()
    c = [0] * B
    for _, i, _ in units[:M]:
        c[i] += 1

    def gain(i: int, pos: int) -> float:  # unit `pos` (0-based) of prompt i, as in the sorted table
        x = v[i]
        a = x * (1.0 - x)
        g = a
        for p in range(3, pos + 1):
            g = min(g, a * (x ** (p - 1) + (1.0 - x) ** (p - 1)))
        return g

    split = [i for i in range(B) if c[i] == 1]
    if not split:
        return c
    c[split[0]] = 0
    best = (-np.inf, None)
    for i in range(B):  # M1: one more unit for an active prompt below the cap
        if 2 <= c[i] < max_rollouts and gain(i, c[i]) > best[0]:
            best = (gain(i, c[i]), [(i, 1)])
    inactive = [i for i in range(B) if c[i] == 0]
    if inactive:
        l = max(inactive, key=lambda i: (v[i] * (1 - v[i]), -i))
        a_l = v[l] * (1 - v[l])
        rem = [i for i in range(B) if c[i] >= 3]
        if rem:  # M2: activate l, drop the cheapest tail unit
            i2 = min(rem, key=lambda i: (gain(i, c[i] - 1), i))
            d = 2 * a_l - gain(i2, c[i2] - 1)
            if d > best[0]:
                best = (d, [(l, 2), (i2, -1)])
    for i, dm in best[1] or []:
        c[i] += dm
    return c


def prefixes_greedy_python(v, r, group, budget, max_per_prefix: Optional[int] = None) -> list[int]:
    """Per-group greedy with a heap over the next marginal gain q^k (1-q), in plain Python (exact)."""
    v = [float(x) for x in v]
    r = [int(x) for x in r]
    group = [int(x) for x in group]
    budget = [int(x) for x in budget]
    members: list[list[int]] = [[] for _ in budget]
    for p, g in enumerate(group):
        members[g].append(p)
    k = [0] * len(v)
    for g, bud in enumerate(budget):
        heap = []
        for p in members[g]:
            q = r[p] * v[p] + (1 - r[p]) * (1 - v[p])
            if max_per_prefix is None or max_per_prefix > 0:
                heap.append((-(1.0 - q), p, q))
        heapq.heapify(heap)
        spent = 0
        while heap and spent < bud:
            neg, p, q = heapq.heappop(heap)
            k[p] += 1
            spent += 1
            if max_per_prefix is None or k[p] < max_per_prefix:
                heapq.heappush(heap, (neg * q, p, q))
    return k
