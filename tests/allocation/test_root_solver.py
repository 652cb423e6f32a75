"""allocate_roots against the exhaustive DP: exactness, constraints, edge cases, determinism."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_mega.allocation import allocate_roots, root_value
from trace_mega.kernels.allocation_ref import root_objective, roots_dp, roots_greedy_python


def _feasible(B, Mmax, M):
    return M != 1 and not (Mmax == 2 and M % 2 and M < B * Mmax)


def _check_exact(v, M, Mmax):
    m = allocate_roots(torch.tensor(v, dtype=torch.float64), M, Mmax)
    _, best = roots_dp(v, M, Mmax)
    assert m.dtype == torch.long
    assert int(m.sum()) == min(M, len(v) * Mmax)
    assert not bool((m == 1).any()) and bool((m >= 0).all()) and bool((m <= Mmax).all())
    assert abs(root_objective(v, m.numpy()) - best) <= 1e-9
    return m


def test_root_value_formula():
    v = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=torch.float64)
    m = torch.tensor([3, 2, 4, 5])
    expect = 1 - v**m - (1 - v) ** m
    assert torch.allclose(root_value(v, m), expect)
    assert torch.equal(root_value(v, 0), torch.zeros(4, dtype=torch.float64))  # skipped prompt
    assert torch.allclose(root_value(v, 1), torch.zeros(4, dtype=torch.float64))  # a lone rollout
    assert root_value(torch.tensor(0.5), 2).item() == pytest.approx(0.5)


@pytest.mark.parametrize("kind", ["uniform", "grid", "tiny", "identical", "binary"])
def test_matches_dp_on_random_instances(kind):
    rng = np.random.default_rng({"uniform": 0, "grid": 1, "tiny": 2, "identical": 3, "binary": 4}[kind])
    for _ in range(150):
        B = int(rng.integers(1, 7))
        Mmax = int(rng.integers(2, 7))
        v = {
            "uniform": lambda: rng.random(B),
            "grid": lambda: rng.integers(0, 5, B) / 4.0,  # many exact ties, v in {0, 1} included
            "tiny": lambda: rng.random(B) * 0.05,  # nearly flat gain chains (the hard parity cases)
            "identical": lambda: np.full(B, rng.random()),
            "binary": lambda: rng.integers(0, 2, B).astype(float),
        }[kind]()
        M = int(rng.integers(0, B * Mmax + 3))
        if _feasible(B, Mmax, M):
            _check_exact(v, M, Mmax)


@settings(max_examples=150, deadline=None)
@given(v=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), Mmax=st.integers(2, 6), frac=st.floats(0, 1.2))
def test_property_exact_and_feasible(v, Mmax, frac):
    M = int(round(frac * len(v) * Mmax))
    if _feasible(len(v), Mmax, M):
        m = _check_exact(v, M, Mmax)
        assert roots_greedy_python(v, M, Mmax) == m.tolist()  # the Python baseline is the same algorithm


def test_python_greedy_is_exact():
    rng = np.random.default_rng(7)
    for _ in range(100):
        B, Mmax = int(rng.integers(1, 6)), int(rng.integers(3, 6))
        v = rng.random(B) * rng.choice([1.0, 0.05])
        M = int(rng.integers(2, B * Mmax + 1))
        assert abs(root_objective(v, roots_greedy_python(v, M, Mmax)) - roots_dp(v, M, Mmax)[1]) <= 1e-9


@pytest.mark.parametrize(
    "v,M,Mmax,expect",
    [
        ([0.89, 0.822, 0.48], 4, 4, [0, 0, 4]),  # M1: the odd unit goes to an active prompt
        ([0.857, 0.034, 0.73, 0.176], 10, 3, [2, 2, 3, 3]),  # M2: activate a prompt, drop a tail unit
    ],
)
def test_parity_fixup_moves(v, M, Mmax, expect):
    from trace_mega.kernels.allocation import root_relaxed_counts, root_unit_gains

    relaxed = root_relaxed_counts(root_unit_gains(torch.tensor(v), Mmax), torch.tensor(M))
    assert int((relaxed == 1).sum()) == 1  # the relaxation is infeasible here: the fix-up is exercised
    assert _check_exact(v, M, Mmax).tolist() == expect
    assert roots_dp(v, M, Mmax)[0].tolist() == expect


def test_edge_cases():
    v = torch.tensor([0.2, 0.5, 0.9])
    assert torch.equal(allocate_roots(v, 0, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="budget 1 is infeasible"):
        allocate_roots(v, 1, 4)
    with pytest.raises(ValueError, match=">= 0"):
        allocate_roots(v, -2, 4)
    with pytest.raises(ValueError, match="odd budget"):
        allocate_roots(v, 3, 2)
    # budget >= B * max_rollouts: everybody gets max_rollouts, the sum is below the budget.
    assert allocate_roots(v, 100, 4).tolist() == [4, 4, 4]
    assert allocate_roots(v, 12, 4).tolist() == [4, 4, 4]
    assert allocate_roots(v, 7, 2).tolist() == [2, 2, 2]  # capacity below an odd budget is fine
    for bad in ([0.2, float("nan"), 0.1], [0.2, 1.5, 0.1], [-0.1, 0.5, 0.5]):
        with pytest.raises(ValueError, match=r"v\[1\]|v\[0\]"):
            allocate_roots(torch.tensor(bad), 4, 4)
    with pytest.raises(ValueError, match="max_rollouts"):
        allocate_roots(v, 4, 1)
    assert allocate_roots(torch.zeros(0), 5, 4).shape == (0,)


def test_tensor_budget_and_dtypes():
    v = torch.rand(50, generator=torch.Generator().manual_seed(3))
    a = allocate_roots(v, 77, 6)
    assert torch.equal(a, allocate_roots(v, torch.tensor(77), 6))
    assert torch.equal(a, allocate_roots(v, torch.tensor(77), 6, check=False))
    assert torch.equal(a, allocate_roots(v.double(), 77, 6))
    with pytest.raises(ValueError, match="budget 1"):
        allocate_roots(v, torch.tensor(1), 6)
    with pytest.raises(ValueError, match="0-d integer"):
        allocate_roots(v, torch.tensor([4]), 6)


def test_ties_are_deterministic_by_index():
    v = torch.full((6,), 0.5)
    m = allocate_roots(v, 6, 3)
    assert m.tolist() == [3, 3, 0, 0, 0, 0]  # equal prompts: lower index first
    assert torch.equal(m, allocate_roots(v, 6, 3))
    m = allocate_roots(torch.tensor([0.0, 1.0, 0.0, 1.0]), 5, 3)  # all gains 0: still spends exactly 5
    assert int(m.sum()) == 5 and not bool((m == 1).any())


def test_moderate_size_matches_dp():
    rng = np.random.default_rng(11)
    v = rng.beta(0.3, 0.3, 40)
    for M in (2, 3, 41, 97, 150):
        _check_exact(v, M, 5)


def test_unchecked_path_never_reads_tensors_back(monkeypatch):
    """check=False with a tensor budget runs without one host read-back (what a GPU sync would be)."""
    v = torch.rand(40, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expect = allocate_roots(v, 33, 5)
    budget = torch.tensor(33)

    def refuse(*args, **kwargs):
        raise AssertionError("host read-back of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = allocate_roots(v, budget, 5, check=False)
    monkeypatch.undo()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("min_rollouts", [2, 3, 4, 5])
def test_minimum_group_equals_the_reference_dp(min_rollouts):
    """m_i in {0} ∪ {min..max}: the solver's objective equals the reference DP's on random and
    U-shaped instances; every group is 0 or at least min_rollouts and the budget is spent."""
    g = torch.Generator().manual_seed(min_rollouts)
    for trial in range(40):
        B = int(torch.randint(1, 12, (1,), generator=g))
        Mmax = int(torch.randint(min_rollouts, 9, (1,), generator=g))
        v = torch.rand(B, generator=g, dtype=torch.float64)
        if trial % 2:
            v = v**4 if trial % 4 == 1 else 1 - v**4  # mass near 0 or 1
        M = int(torch.randint(0, B * Mmax + 3, (1,), generator=g))
        ref, best = roots_dp(v.tolist(), M, Mmax, min_rollouts)
        if ref is None:
            with pytest.raises(ValueError, match="cannot be spent|infeasible"):
                allocate_roots(v, M, Mmax, min_rollouts=min_rollouts)
            continue
        m = allocate_roots(v, M, Mmax, min_rollouts=min_rollouts)
        assert int(m.sum()) == min(M, B * Mmax)
        assert bool(((m == 0) | ((m >= min_rollouts) & (m <= Mmax))).all())
        assert root_objective(v.tolist(), m.tolist()) == pytest.approx(best, abs=1e-9)


def test_minimum_group_budget_errors_name_the_rule():
    v = torch.full((4,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot be spent exactly"):
        allocate_roots(v, 3, 8, min_rollouts=4)  # 0 < 3 < 4
    with pytest.raises(ValueError, match="min_rollouts must lie"):
        allocate_roots(v, 8, 4, min_rollouts=5)
    assert allocate_roots(v, 8, 8, min_rollouts=4).tolist().count(4) == 2  # 4 + 4 beats 8 at v = 0.5
