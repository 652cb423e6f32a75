"""Deterministic balancing of whole trees over ranks and batches."""

from __future__ import annotations

import math
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


def contrast_bins(sizes: Sequence[int], contrasted: Sequence[bool], per_bin: int, most: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 in n = round(#contrasted / per_bin) bins (1 <= n <= `most`),
    deterministically, each bin holding an equal share of the contrasted indices (±1).

    The contrasted indices go first, largest first into the bin with the fewest of them (then the
    least load); the others follow into the bin with the fewest indices (then the least load), so
    every bin has at least len(sizes) // n indices. Used for mini-batches sized by contrast
    (`optim.contrasted_trees_per_mini_batch`): a step whose groups carry more signal takes more
    optimiser steps.
    """
    c = sum(bool(x) for x in contrasted)
    n = max(1, min(most, math.floor(c / per_bin + 0.5)))
    bins: list[list[int]] = [[] for _ in range(n)]
    load, count, kept = [0] * n, [0] * n, [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: (not contrasted[i], -sizes[i], i)):
        first = kept if contrasted[i] else count
        b = min(range(n), key=lambda b: (first[b], load[b], b))
        bins[b].append(i)
        load[b] += sizes[i]
        count[b] += 1
        kept[b] += bool(contrasted[i])
    return [sorted(b) for b in bins]
