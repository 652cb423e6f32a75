"""The allocator registry: names, equal trajectory budgets, and each allocator's own rule."""

import dataclasses

import pytest
import torch

from trace_mega.allocation import ALLOCATORS, allocate_prefixes, allocate_roots, build_allocator
from trace_mega.allocation.allocators import flat_groups, split_budget
from trace_mega.config import AllocationConfig, ConfigError
from trace_mega.kernels.allocation_ref import root_objective, roots_dp

NAMES = ["pcl", "trace", "trace_global", "treepo", "uniform"]


def _problem(B=32, seed=0):
    """A seeded generator and random root values."""
    g = torch.Generator().manual_seed(seed)
    v_root = torch.rand(B, generator=g)
    return g, v_root


def _prefixes_for(m, turns, g):
    """Random prefixes, turns - 1 per bare rollout, grouped by prompt."""
    group = torch.repeat_interleave(torch.arange(m.numel()), m * (turns - 1))
    P = group.numel()
    return torch.rand(P, generator=g), torch.randint(0, 2, (P,), generator=g), group


def test_registry_names_and_errors():
    assert ALLOCATORS.names() == ["dapo", *NAMES]  # dapo's rounds: tests/allocation/test_dapo.py
    with pytest.raises(
        ConfigError, match=r"^allocation\.name: .* valid names: dapo, pcl, trace, trace_global, treepo, uniform"
    ):
        build_allocator(AllocationConfig(name="nope"))


@pytest.mark.parametrize("N", [1.0, 0.5, 1.75])
@pytest.mark.parametrize("name", NAMES)
def test_equal_budget(name, N):
    cfg = AllocationConfig(
        name=name,
        prompts_per_step=32,
        root_rollouts_per_step=50,
        rollouts_per_prompt_max=8,
        group_size=4,
        continuations_per_rollout=N,
    )
    alloc = build_allocator(cfg)
    total = 50 + round(50 * N)
    assert alloc.trajectories_per_step == total
    for seed in range(3):
        g, v_root = _problem(seed=seed)
        m = alloc.plan_roots(v_root, g)
        assert m.dtype == torch.long and not bool((m == 1).any())
        v, r, group = _prefixes_for(m, 4, g)
        k = alloc.plan_prefixes(v, r, group, m, g)
        assert int(m.sum()) + int(k.sum()) == total
        if alloc.tree:
            assert int(m.sum()) == 50
        else:
            assert int(k.sum()) == 0 and set(m[m > 0].tolist()) <= {4, 5}


def test_pcl_picks_prompts_nearest_half():
    cfg = AllocationConfig(
        name="pcl", prompts_per_step=6, root_rollouts_per_step=4, group_size=4, continuations_per_rollout=1.0
    )
    m = build_allocator(cfg).plan_roots(torch.tensor([0.0, 0.45, 0.9, 0.55, 0.5, 1.0]))
    assert m.tolist() == [0, 4, 0, 0, 4, 0]


def test_uniform_and_treepo_are_seeded():
    for name in ("uniform", "treepo"):
        alloc = build_allocator(AllocationConfig(name=name, prompts_per_step=32, root_rollouts_per_step=32))
        v = torch.rand(32)
        a = alloc.plan_roots(v, torch.Generator().manual_seed(1))
        assert torch.equal(a, alloc.plan_roots(v, torch.Generator().manual_seed(1)))
        assert not torch.equal(a, alloc.plan_roots(v, torch.Generator().manual_seed(2)))


def test_treepo_spreads_evenly_at_random():
    alloc = build_allocator(
        AllocationConfig(
            name="treepo", prompts_per_step=4, root_rollouts_per_step=8, group_size=4, continuations_per_rollout=1.0
        )
    )
    m = torch.tensor([4, 0, 4, 0])
    group = torch.tensor([0] * 3 + [2] * 5)
    k = alloc.plan_prefixes(torch.rand(8), torch.ones(8), group, m, torch.Generator().manual_seed(0))
    assert sorted(k[:3].tolist()) == [1, 1, 2] and sorted(k[3:].tolist()) == [0, 1, 1, 1, 1]


def test_trace_uses_exact_solvers():
    cfg = AllocationConfig(
        name="trace",
        prompts_per_step=16,
        root_rollouts_per_step=30,
        rollouts_per_prompt_max=6,
        continuations_per_rollout=1.5,
        continuations_per_prefix_max=3,
    )
    g, v_root = _problem(B=16, seed=4)
    alloc = build_allocator(cfg)
    m = alloc.plan_roots(v_root, g)
    assert torch.equal(m, allocate_roots(v_root, 30, 6))
    v, r, group = _prefixes_for(m, 3, g)
    budget = alloc.prefix_budgets(m)
    assert int(budget.sum()) == 45 and bool((budget[m == 0] == 0).all())
    assert torch.equal(alloc.plan_prefixes(v, r, group, m), allocate_prefixes(v, r, group, budget, 3))
    glob = build_allocator(AllocationConfig(**{**cfg.__dict__, "name": "trace_global"}))
    assert torch.equal(glob.plan_prefixes(v, r, group, m), allocate_prefixes(v, r, group, budget, 3, pool="global"))
    hot = build_allocator(cfg, check=False, max_group_size=6 * 2)  # the sync-free settings give the same plan
    assert torch.equal(hot.plan_roots(v_root), m) and torch.equal(
        hot.plan_prefixes(v, r, group, m), alloc.plan_prefixes(v, r, group, m)
    )


def test_trace_rejects_budgets_it_cannot_spend():
    with pytest.raises(ValueError, match="exceeds"):
        build_allocator(AllocationConfig(name="trace", prompts_per_step=4, root_rollouts_per_step=40))
    with pytest.raises(ValueError, match="odd root budget"):
        build_allocator(AllocationConfig(name="trace_global", root_rollouts_per_step=9, rollouts_per_prompt_max=2))


def test_helpers():
    order = torch.tensor([3, 1, 0, 2])
    assert flat_groups(order, 10, 4).tolist() == [0, 5, 0, 5]
    assert flat_groups(order, 3, 4).tolist() == [0, 0, 0, 3]
    assert flat_groups(order, 40, 4).tolist() == [10, 10, 10, 10]  # pool too small: bigger groups
    assert flat_groups(order, 0, 4).tolist() == [0, 0, 0, 0]
    b = split_budget(torch.tensor([3, 0, 2, 5]), 0.5, 5)
    assert b.tolist() == [2, 0, 1, 2] and int(b.sum()) == 5  # floors 1,0,1,2; largest fractions first


def test_predictor_free_counterparts():
    """What the next step runs when the predictor lost to a constant: the allocator decides."""
    cfg = AllocationConfig(prompts_per_step=8, root_rollouts_per_step=16, rollouts_per_prompt_max=4)
    want = {"trace": "treepo", "trace_global": "treepo", "pcl": "uniform", "treepo": "treepo", "uniform": "uniform"}
    want["dapo"] = "dapo"
    assert set(want) == set(ALLOCATORS.names())
    for name, counterpart in want.items():
        alloc = build_allocator(
            AllocationConfig(**{**cfg.__dict__, "name": name}), check=False, max_group_size=12, min_trees=2
        )
        free = alloc.without_predictor()
        assert free.name == counterpart and not free.uses_predictor
        assert alloc.uses_predictor == (counterpart != name) and (free is alloc) == (counterpart == name)
        # Same budget and the same sync-free solver options as the allocator it stands in for.
        assert free.trajectories_per_step == alloc.trajectories_per_step
        assert (free.check, free.max_group_size, free.min_trees) == (False, 12, 2)


def test_trace_exploration_floor_serves_prompts_the_solver_starves():
    """Rare-success prompts (v = 0.1) next to v = 0.5 ones: the solver alone gives them nothing;
    exploration_fraction 0.25 gives 2 rollouts each to 4 random prompts, at the same budget."""
    v = torch.tensor([0.5] * 8 + [0.1] * 24)
    base = dict(name="trace", prompts_per_step=32, root_rollouts_per_step=32, rollouts_per_prompt_max=8)
    m0 = build_allocator(AllocationConfig(**base)).plan_roots(v, torch.Generator().manual_seed(0))
    assert int(m0[8:].sum()) == 0 and int(m0.sum()) == 32
    served = set()
    for seed in range(6):
        m = build_allocator(AllocationConfig(**base, exploration_fraction=0.25)).plan_roots(
            v, torch.Generator().manual_seed(seed)
        )
        assert int(m.sum()) == 32 and int((m == 1).sum()) == 0
        assert int((m[8:] >= 2).sum()) >= 2  # random draws: 4 explored prompts, most of them rare
        served |= set(torch.nonzero(m[8:]).flatten().tolist())
    assert len(served) > 8  # the explored prompts change with the step's generator


@pytest.mark.parametrize("explore", [0.0, 0.25])
def test_trace_minimum_group_is_the_baselines_group_size(explore):
    """rollouts_per_prompt_min = group_size: every active prompt gets >= 4 roots (the baselines'
    groups), the budget is spent exactly, and the plan is the exact optimum over {0} ∪ {4..8}."""
    v = torch.rand(32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cfg = AllocationConfig(
        name="trace",
        prompts_per_step=32,
        root_rollouts_per_step=32,
        rollouts_per_prompt_max=8,
        rollouts_per_prompt_min=4,
        exploration_fraction=explore,
    )
    m = build_allocator(cfg).plan_roots(v, torch.Generator().manual_seed(0))
    assert int(m.sum()) == 32 and bool(((m == 0) | (m >= 4)).all())
    if not explore:
        assert root_objective(v.tolist(), m.tolist()) == pytest.approx(roots_dp(v.tolist(), 32, 8, 4)[1], abs=1e-9)
    with pytest.raises(ValueError, match="rollouts_per_prompt_min"):
        build_allocator(dataclasses.replace(cfg, root_rollouts_per_step=3))


def test_trace_sampled_roots_serve_prompts_in_proportion_to_their_contrast():
    """root_selection=sampled, one group of 4 a step from 16 candidates at v = 1/2 (a contrasted group
    of 4 with chance 0.875) and 16 at v = 0.9 (0.344): the solver alone always takes a v = 1/2 one; the
    sampled plan takes each kind about in proportion to that chance (dynamic sampling's kept groups),
    never a solved prompt (v = 1, chance 0) while others are accepted, and is a function of the generator."""
    v = torch.tensor([0.5] * 16 + [0.9] * 16 + [1.0] * 16)
    base = dict(name="trace", prompts_per_step=48, root_rollouts_per_step=4, rollouts_per_prompt_max=4)
    base |= dict(rollouts_per_prompt_min=4, group_size=4)
    solver = build_allocator(AllocationConfig(**base))
    sampled = build_allocator(AllocationConfig(**base, root_selection="sampled"))
    picks = {"half": 0, "high": 0, "solved": 0}
    for seed in range(600):
        assert bool((solver.plan_roots(v, torch.Generator().manual_seed(seed))[:16] == 4).any())
        m = sampled.plan_roots(v, torch.Generator().manual_seed(seed))
        assert int(m.sum()) == 4 and int((m > 0).sum()) == 1
        i = int(torch.nonzero(m)[0, 0])
        picks["half" if i < 16 else "high" if i < 32 else "solved"] += 1
    assert picks["solved"] == 0
    assert 2.0 < picks["half"] / picks["high"] < 3.2  # 0.875 / 0.344 = 2.54
    again = sampled.plan_roots(v, torch.Generator().manual_seed(7))
    assert torch.equal(again, sampled.plan_roots(v, torch.Generator().manual_seed(7)))
