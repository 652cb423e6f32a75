"""kernels.allocation: the tensor-program hot paths and the Triton bisection kernel (interpreter on CPU)."""

import numpy as np
import pytest
import torch

from trace_mega.kernels.allocation import dense_layout, root_relaxed_counts, root_unit_gains, segmented_threshold
from trace_mega.kernels.allocation_ref import prefix_objective, prefixes_dp


def test_root_unit_gains_are_the_marginals():
    v = torch.tensor([0.0, 0.2, 0.5, 0.93, 1.0], dtype=torch.float64)
    U = root_unit_gains(v, 6)
    m = torch.arange(7, dtype=torch.float64)
    f = 1 - v[:, None] ** m - (1 - v[:, None]) ** m  # (B, 7), f(0) = -1 by the formula
    f[:, 0] = 0
    assert torch.allclose(U[:, 0] + U[:, 1], f[:, 2])
    assert torch.allclose(U[:, 2:], f[:, 3:] - f[:, 2:-1], atol=1e-15)
    assert bool((U[:, 1:] <= U[:, :-1]).all())


def test_relaxed_counts_are_top_units_with_index_ties():
    U = root_unit_gains(torch.tensor([0.5, 0.5, 0.1]), 3)
    assert root_relaxed_counts(U, torch.tensor(4)).tolist() == [3, 1, 0]
    assert root_relaxed_counts(U, torch.tensor(0)).tolist() == [0, 0, 0]
    assert root_relaxed_counts(U, torch.tensor(9)).tolist() == [3, 3, 3]


def test_dense_layout():
    group = torch.tensor([1, 0, 1, 1, 0])
    perm, slot, W = dense_layout(group, 3)
    assert W == 3 and perm.tolist() == [1, 4, 0, 2, 3] and slot.tolist() == [0, 1, 3, 4, 5]
    assert dense_layout(group, 3, width=4)[1].tolist() == [0, 1, 4, 5, 6]


def _instance(seed, P, G, binary=False):
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 3, P) / 2.0 if binary else rng.random(P)
    r = rng.integers(0, 2, P)
    group = rng.integers(0, G, P)
    budget = rng.integers(0, 9, G)
    flip = torch.tensor(r * (1 - v) + (1 - r) * v)
    return v, r, group, budget, flip


@pytest.mark.parametrize("seed", range(4))
def test_torch_threshold_is_exact(seed):
    v, r, group, budget, flip = _instance(seed, 9, 3, binary=seed % 2 == 1)
    cap = torch.minimum(torch.tensor(budget)[group], torch.tensor(3))
    k = segmented_threshold(flip, torch.tensor(group), torch.tensor(budget), cap)
    _, best = prefixes_dp(v, r, group, budget, 3)
    assert abs(prefix_objective(v, r, k.numpy()) - best) <= 1e-9


@pytest.mark.parametrize("seed,P,G", [(0, 12, 3), (1, 70, 2), (2, 5, 4)])
def test_triton_kernel_matches_tensor_program(seed, P, G):
    v, r, group, budget, flip = _instance(seed, P, G, binary=seed == 2)
    group_t, budget_t = torch.tensor(group), torch.tensor(budget)
    cap = budget_t[group_t]
    ref = segmented_threshold(flip, group_t, budget_t, cap, backend="torch", iters=24)
    out = segmented_threshold(flip, group_t, budget_t, cap, backend="triton", iters=24)
    assert torch.equal(out, ref)  # P = 70 spans two 64-wide chunks of one segment
    _, best = prefixes_dp(v, r, group, budget)
    assert abs(prefix_objective(v, r, out.numpy()) - best) <= 1e-6


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        segmented_threshold(
            torch.rand(3),
            torch.zeros(3, dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([2, 2, 2]),
            backend="cuda-magic",
        )


@pytest.mark.gpu
def test_gpu_matches_cpu_and_triton():
    rng = np.random.default_rng(0)
    P, G = 5000, 300
    v, r, group, budget, flip = _instance(0, P, G)
    args = [torch.tensor(x) for x in (group, budget)]
    cap = args[1][args[0]]
    cpu = segmented_threshold(flip, *args, cap)
    dev = [t.cuda() for t in (flip, *args, cap)]
    assert torch.equal(segmented_threshold(*dev).cpu(), cpu)
    assert torch.equal(segmented_threshold(*dev, backend="triton").cpu(), cpu)
    from trace_mega.allocation import allocate_prefixes, allocate_roots

    vr = torch.tensor(rng.random(1000))
    assert torch.equal(allocate_roots(vr.cuda(), 3001, 8).cpu(), allocate_roots(vr, 3001, 8))
    # The hot paths with check=False (and a known group bound) never synchronise with the host.
    pv, pr, pg, pb = (torch.tensor(x).cuda() for x in (v, r, group, budget))
    width = int(torch.bincount(torch.tensor(group)).max())
    bud = torch.tensor(3001, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m = allocate_roots(vr.cuda(), bud, 8, check=False)
        k = allocate_prefixes(pv, pr, pg, pb, check=False, max_group_size=width)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(m.cpu(), allocate_roots(vr, 3001, 8))
    assert torch.equal(k.cpu(), allocate_prefixes(*(torch.tensor(x) for x in (v, r, group, budget))))
