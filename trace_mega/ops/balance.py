"""Deterministic balancing of whole trees over ranks and batches."""

from __future__ import annotations

from typing import Sequence


def balanced_bins(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 in `n` bins of near-equal total size, deterministically.

    Largest first into the least-loaded bin (ties: the lower index, the lower bin); each bin's
    indices are returned in ascending order. Used for mini-batches (n = mini-batches per step)
    and for micro-batches (n = DP size x micro-batches per rank).
    """
    bins: list[list[int]] = [[] for _ in range(max(n, 1))]
    load = [0] * len(bins)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(len(bins)), key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += sizes[i]
    return [sorted(b) for b in bins]
