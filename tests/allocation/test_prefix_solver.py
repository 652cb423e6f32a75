"""allocate_prefixes against the exhaustive DP: per-group and global pools, caps, ties, edge cases."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_mega.allocation import allocate_prefixes, prefix_value
from trace_mega.kernels.allocation_ref import prefix_objective, prefixes_dp, prefixes_greedy_python


def _group_sums(k, group, G):
    return torch.zeros(G, dtype=torch.long).index_add_(0, group, k)


def _check_exact(v, r, group, budget, cap=None):
    v, r = torch.as_tensor(v, dtype=torch.float64), torch.as_tensor(r)
    group, budget = torch.as_tensor(group), torch.as_tensor(budget)
    k = allocate_prefixes(v, r, group, budget, cap)
    _, best = prefixes_dp(v.numpy(), r.numpy(), group.numpy(), budget.numpy(), cap)
    assert k.dtype == torch.long and bool((k >= 0).all())
    if cap is not None:
        assert bool((k <= cap).all())
    caps = torch.minimum(budget[group], torch.tensor(cap if cap is not None else 1 << 40))
    spend = torch.minimum(budget, _group_sums(caps, group, len(budget)))
    assert torch.equal(_group_sums(k, group, len(budget)), spend)
    assert abs(prefix_objective(v.numpy(), r.numpy(), k.numpy()) - best) <= 1e-9
    return k


def test_prefix_value_formula():
    v = torch.tensor([0.2, 0.2, 0.9, 0.5], dtype=torch.float64)
    r = torch.tensor([1, 0, 1, 0])
    k = torch.tensor([2, 2, 3, 0])
    q = r * v + (1 - r) * (1 - v)
    assert torch.allclose(prefix_value(v, r, k), 1 - q**k)
    assert prefix_value(torch.tensor(0.2), torch.tensor(1), 1).item() == pytest.approx(0.8)  # success seen, 0.8 flip


@pytest.mark.parametrize("kind", ["uniform", "grid", "identical", "binary"])
def test_matches_dp_on_random_instances(kind):
    rng = np.random.default_rng({"uniform": 0, "grid": 1, "identical": 2, "binary": 3}[kind])
    for t in range(120):
        P, G = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        v = {
            "uniform": lambda: rng.random(P),
            "grid": lambda: rng.integers(0, 5, P) / 4.0,
            "identical": lambda: np.full(P, rng.random()),
            "binary": lambda: rng.integers(0, 2, P).astype(float),
        }[kind]()
        r = rng.integers(0, 2, P)
        group = rng.integers(0, G, P)
        budget = rng.integers(0, 8, G)
        cap = None if t % 3 == 0 else int(rng.integers(0, 4))
        _check_exact(v, r, group, budget, cap)


@settings(max_examples=120, deadline=None)
@given(data=st.data(), P=st.integers(1, 8), G=st.integers(1, 3), cap=st.one_of(st.none(), st.integers(0, 4)))
def test_property_exact(data, P, G, cap):
    v = data.draw(st.lists(st.floats(0, 1), min_size=P, max_size=P))
    r = data.draw(st.lists(st.integers(0, 1), min_size=P, max_size=P))
    group = data.draw(st.lists(st.integers(0, G - 1), min_size=P, max_size=P))
    budget = data.draw(st.lists(st.integers(0, 9), min_size=G, max_size=G))
    k = _check_exact(v, r, group, budget, cap)
    kp = prefixes_greedy_python(v, r, group, budget, cap)
    assert abs(prefix_objective(v, r, kp) - prefix_objective(v, r, k.numpy())) <= 1e-9


def test_global_pool_is_exact_and_moves_budget():
    rng = np.random.default_rng(5)
    for _ in range(60):
        P, G = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        v, r, group = rng.random(P), rng.integers(0, 2, P), rng.integers(0, G, P)
        budget = torch.as_tensor(rng.integers(0, 5, G))
        cap = int(rng.integers(1, 4))
        k = allocate_prefixes(torch.tensor(v), torch.tensor(r), torch.tensor(group), budget, cap, pool="global")
        _, best = prefixes_dp(v, r, np.zeros(P, dtype=int), [int(budget.sum())], cap)
        assert int(k.sum()) == min(int(budget.sum()), P * cap)
        assert abs(prefix_objective(v, r, k.numpy()) - best) <= 1e-9
    # Prompt 0's prefixes are certain (q = 1) and prompt 1's are coin flips: the global pool moves the budget.
    v = torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    r, group, budget = torch.tensor([1, 1, 0, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([4, 0])
    assert allocate_prefixes(v, r, group, budget).tolist() == [4, 0, 0, 0]  # the paper's per-prompt pool is stuck
    assert allocate_prefixes(v, r, group, budget, pool="global").tolist() == [0, 0, 2, 2]
    assert allocate_prefixes(v, r, group, 4, pool="global").tolist() == [0, 0, 2, 2]  # int total


def test_edge_cases_and_ties():
    v = torch.tensor([0.5, 0.5, 0.5])
    r = torch.tensor([1, 1, 1])
    g = torch.tensor([0, 0, 0])
    assert allocate_prefixes(v, r, g, torch.tensor([0])).tolist() == [0, 0, 0]
    assert allocate_prefixes(v, r, g, torch.tensor([4])).tolist() == [2, 1, 1]  # identical prefixes: index order
    assert allocate_prefixes(v, r, g, torch.tensor([10]), max_per_prefix=2).tolist() == [2, 2, 2]  # caps bind
    # A group without prefixes spends nothing; v in {0, 1} (gain 0) still spends the budget exactly.
    k = allocate_prefixes(torch.tensor([1.0, 0.0]), torch.tensor([1, 0]), torch.tensor([1, 1]), torch.tensor([5, 3]))
    assert k.tolist() == [3, 0]
    # A certain flip (q = 0) takes one unit before any zero-gain unit.
    k = allocate_prefixes(torch.tensor([1.0, 0.0]), torch.tensor([1, 1]), torch.tensor([0, 0]), torch.tensor([3]))
    assert k.tolist() == [2, 1]
    # A subnormal flip probability (log1p underflows to -0.0) still loses to a certain flip.
    k = allocate_prefixes(
        torch.tensor([0.0, 5e-324], dtype=torch.float64), torch.tensor([1, 0]), torch.tensor([0, 0]), torch.tensor([1])
    )
    assert k.tolist() == [1, 0]
    for bad_v in ([0.5, float("nan"), 0.5], [0.5, 1.2, 0.5]):
        with pytest.raises(ValueError, match="v"):
            allocate_prefixes(torch.tensor(bad_v), r, g, torch.tensor([2]))
    with pytest.raises(ValueError, match="0/1"):
        allocate_prefixes(v, torch.tensor([1, 2, 0]), g, torch.tensor([2]))
    with pytest.raises(ValueError, match="group indices"):
        allocate_prefixes(v, r, torch.tensor([0, 1, 0]), torch.tensor([2]))
    with pytest.raises(ValueError, match=">= 0"):
        allocate_prefixes(v, r, g, torch.tensor([-1]))
    with pytest.raises(ValueError, match="pool"):
        allocate_prefixes(v, r, g, torch.tensor([2]), pool="nope")
    assert allocate_prefixes(
        torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.tensor([3])
    ).shape == (0,)


def test_max_group_size_bound():
    rng = np.random.default_rng(3)
    v, r, group = (
        torch.tensor(rng.random(20)),
        torch.tensor(rng.integers(0, 2, 20)),
        torch.tensor(rng.integers(0, 3, 20)),
    )
    budget = torch.tensor([4, 7, 2])
    ref = allocate_prefixes(v, r, group, budget)
    assert torch.equal(allocate_prefixes(v, r, group, budget, max_group_size=20, check=False), ref)  # a loose bound
    with pytest.raises(ValueError, match="max_group_size"):
        allocate_prefixes(v, r, group, budget, max_group_size=2)


def test_large_budget_and_unordered_groups():
    rng = np.random.default_rng(9)
    P, G = 60, 7
    v, r, group = rng.random(P), rng.integers(0, 2, P), rng.integers(0, G, P)
    _check_exact(v, r, group, rng.integers(0, 40, G))
    _check_exact(v, r, group, rng.integers(0, 40, G), cap=3)
