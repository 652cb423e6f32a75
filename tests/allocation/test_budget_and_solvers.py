"""Exactly equal budgets, host-sync freedom (on `meta` tensors), NaN-safe predictions and random ties."""

import logging

import pytest
import torch

from trace_mega.allocation import allocate_prefixes, allocate_roots, build_allocator
from trace_mega.allocation import allocators as alloc_mod
from trace_mega.config import AllocationConfig

NAMES = ["pcl", "trace", "trace_global", "treepo", "uniform"]


def _plan(alloc, v_root, prefixes_per_rollout, g, v_prefix=None):
    """Roots, then prefixes (prefixes_per_rollout(prompt, rollout) of each bare rollout), then root continuations."""
    m = alloc.plan_roots(v_root, g)
    group, r = [], []
    for i, mi in enumerate(m.tolist()):
        for j in range(mi):
            n = prefixes_per_rollout(i, j)
            group += [i] * n
            r += [(i + j) % 2] * n
    group, r = torch.tensor(group, dtype=torch.long), torch.tensor(r, dtype=torch.float64)
    v = torch.rand(group.numel(), generator=g, dtype=torch.float64) if v_prefix is None else v_prefix(group)
    k = alloc.plan_prefixes(v, r, group, m, g)
    extra = alloc.plan_root_continuations(m, k, g)
    return m, group, k, extra


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", ["one_turn_prompts", "caps_bind", "no_prefix_at_all"])
def test_every_allocator_spends_exactly_the_budget(name, case):
    cap = 1 if case == "caps_bind" else None
    cfg = AllocationConfig(
        name=name,
        prompts_per_step=12,
        root_rollouts_per_step=16,
        rollouts_per_prompt_max=4,
        group_size=4,
        continuations_per_rollout=1.5,
        continuations_per_prefix_max=cap,
    )
    alloc = build_allocator(cfg)
    shapes = {
        # every even prompt's rollouts answer in one turn (no intermediate prefix); the rest have 2
        "one_turn_prompts": lambda i, j: 0 if i % 2 == 0 else 2,
        # one prefix per rollout and at most 1 continuation on it: 1.5 per rollout cannot fit
        "caps_bind": lambda i, j: 1,
        "no_prefix_at_all": lambda i, j: 0,
    }[case]
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        m, group, k, extra = _plan(alloc, torch.rand(12, generator=g), shapes, g)
        assert int(m.sum() + k.sum() + extra.sum()) == 16 + 24 == alloc.trajectories_per_step, (name, case, seed)
        assert bool((extra[m == 0] == 0).all()) and bool((k >= 0).all()) and bool((extra >= 0).all())
        if cap is not None:
            assert k.numel() == 0 or int(k.max()) <= cap
        if alloc.tree:
            assert int(m.sum()) == 16
            # budget moves to prefixes before it becomes fresh root rollouts
            room = group.numel() * (cap if cap is not None else 10**9)
            if int(k.sum()) < 24:
                assert int(k.sum()) == min(room, 24)
        else:
            assert int(k.sum()) == 0 and int(extra.sum()) == 0


def test_unspendable_budget_moves_to_other_prompts_prefixes_first():
    cfg = AllocationConfig(
        name="trace",
        prompts_per_step=4,
        root_rollouts_per_step=8,
        rollouts_per_prompt_max=4,
        continuations_per_rollout=1.0,
    )
    alloc = build_allocator(cfg)
    m = torch.tensor([4, 4, 0, 0])
    group = torch.tensor([1] * 6)  # prompt 0's four rollouts answered in one turn
    v = torch.linspace(0.1, 0.9, 6, dtype=torch.float64)
    k = alloc.plan_prefixes(v, torch.ones(6), group, m)
    assert int(k.sum()) == 8  # prompt 0's budget of 4 went to prompt 1's prefixes
    # the extension is the exact greedy over the remaining marginal gains: same as one pool of 8
    assert torch.equal(k, allocate_prefixes(v, torch.ones(6), torch.zeros(6, dtype=torch.long), 8, pool="global"))
    assert int(alloc.plan_root_continuations(m, k).sum()) == 0


def test_allocators_warn_once_when_selection_is_a_no_op(caplog):
    alloc_mod._WARNED.clear()
    cfg = AllocationConfig(name="pcl", prompts_per_step=16, root_rollouts_per_step=32, group_size=4)
    with caplog.at_level(logging.WARNING, logger="trace_mega.allocation.allocators"):
        build_allocator(cfg)
        build_allocator(cfg)
        build_allocator(AllocationConfig(name="pcl", prompts_per_step=32, root_rollouts_per_step=32, group_size=4))
    msgs = [r.message for r in caplog.records if "no-op" in r.message]
    assert len(msgs) == 1 and "pcl" in msgs[0]


def test_shipped_configs_give_pcl_a_pool_larger_than_the_budget():
    from pathlib import Path

    from trace_mega.config import TrainConfig, load_yaml

    for path in sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")):
        if path.name.startswith("pretrain_"):  # warm-start configs (PretrainConfig) allocate nothing
            continue
        cfg = load_yaml(TrainConfig, path).allocation
        for name in ("pcl", "uniform", "treepo", "trace"):
            assert not build_allocator(AllocationConfig(**{**cfg.__dict__, "name": name})).selection_is_a_no_op(), (
                path.name,
                name,
            )


# --- no host sync: the device path runs on `meta` tensors, which refuse any data-dependent host read ----
def test_solvers_and_allocators_run_on_meta_tensors_without_host_reads():
    B, P, Mmax = 16, 60, 8
    v = torch.empty(B, dtype=torch.float64, device="meta")
    m = allocate_roots(v, 32, Mmax, check=False)
    assert m.device.type == "meta" and m.shape == (B,)
    m = allocate_roots(v, torch.full((), 32, device="meta"), Mmax, check=False)
    pv = torch.empty(P, dtype=torch.float64, device="meta")
    group = torch.zeros(P, dtype=torch.long, device="meta")
    budget = torch.zeros(B, dtype=torch.long, device="meta")
    for pool in ("group", "global"):
        k = allocate_prefixes(
            pv, torch.empty(P, device="meta"), group, budget, 3, pool=pool, check=False, max_group_size=P
        )
        assert k.device.type == "meta" and k.shape == (P,)
    for name in NAMES:
        cfg = AllocationConfig(
            name=name,
            prompts_per_step=B,
            root_rollouts_per_step=32,
            rollouts_per_prompt_max=Mmax,
            continuations_per_prefix_max=2,
        )
        alloc = build_allocator(cfg, check=False, max_group_size=P)
        g = torch.Generator().manual_seed(0)
        m = alloc.plan_roots(v, g)
        k = alloc.plan_prefixes(pv, torch.empty(P, device="meta"), group, m, g)
        extra = alloc.plan_root_continuations(m, k, g)
        assert {m.device.type, k.device.type, extra.device.type} == {"meta"}, name


def test_the_meta_check_catches_a_host_read():
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.bincount(torch.zeros(3, dtype=torch.long, device="meta"))
    with pytest.raises(RuntimeError, match="meta"):
        torch.zeros(3, device="meta")[torch.zeros((), dtype=torch.long, device="meta")]


# --- NaN / inf predictions --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_predictions_are_replaced_and_counted(name):
    cfg = AllocationConfig(name=name, prompts_per_step=8, root_rollouts_per_step=16, rollouts_per_prompt_max=4)
    alloc = build_allocator(cfg)
    v_root = torch.tensor([0.2, float("nan"), 0.7, float("inf"), 0.5, -float("inf"), 0.4, 0.9], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    m = alloc.plan_roots(v_root, g)
    group = torch.repeat_interleave(torch.arange(8), m * 2)
    v = torch.full((group.numel(),), float("nan"), dtype=torch.float64)
    k = alloc.plan_prefixes(v, torch.ones(group.numel()), group, m, g)
    assert int(m.sum() + k.sum() + alloc.plan_root_continuations(m, k, g).sum()) == 32
    expect = (0 if name == "treepo" else 3) + (group.numel() if alloc.tree else 0)  # treepo ignores v_root
    assert alloc.metrics() == {"alloc/invalid_predictions": float(expect)}
    assert alloc.metrics() == {"alloc/invalid_predictions": 0.0}  # counted once


# --- random ties ------------------------------------------------------------------------------------------
def test_equal_predictions_spread_continuations_over_all_bare_rollouts():
    cfg = AllocationConfig(
        name="trace",
        prompts_per_step=1,
        root_rollouts_per_step=8,
        rollouts_per_prompt_max=8,
        continuations_per_rollout=1.0,
    )
    alloc = build_allocator(cfg)
    m = torch.tensor([8])
    rollout = torch.repeat_interleave(torch.arange(8), 3)  # 3 prefixes per bare rollout, in order
    group = torch.zeros(24, dtype=torch.long)
    v = torch.full((24,), 0.5, dtype=torch.float64)  # step 0: every prediction 0.5
    by_index = alloc.plan_prefixes(v, torch.ones(24), group, m)  # no generator: the solver's index order
    assert set(rollout[by_index > 0].tolist()) == {0, 1, 2}
    covered, distinct = set(), []
    for seed in range(20):
        k = alloc.plan_prefixes(v, torch.ones(24), group, m, torch.Generator().manual_seed(seed))
        assert int(k.sum()) == 8
        hit = set(rollout[k > 0].tolist())
        covered |= hit
        distinct.append(len(hit))
    assert covered == set(range(8)) and sum(distinct) / len(distinct) >= 5  # E = 5.8 for 8 random of 24
    # equal root predictions: the prompts that get rollouts vary with the seed, not always the first
    roots = build_allocator(
        AllocationConfig(name="trace", prompts_per_step=16, root_rollouts_per_step=20, rollouts_per_prompt_max=8)
    )
    v_root = torch.full((16,), 0.5, dtype=torch.float64)
    used = set()
    for seed in range(10):
        mm = roots.plan_roots(v_root, torch.Generator().manual_seed(seed))
        assert int(mm.sum()) == 20
        used |= set(torch.nonzero(mm).flatten().tolist())
    assert used == set(range(16))


@pytest.mark.gpu
def test_allocators_on_cuda_never_synchronise_with_the_host():
    B, P = 64, 400
    g = torch.Generator().manual_seed(0)
    v_root = torch.rand(B, generator=g, dtype=torch.float64).cuda()
    v = torch.rand(P, generator=g, dtype=torch.float64).cuda()
    v[3] = float("nan")
    r = torch.randint(0, 2, (P,), generator=g).double().cuda()
    group = torch.sort(torch.randint(0, B, (P,), generator=g)).values.cuda()
    for name in NAMES:
        cfg = AllocationConfig(
            name=name,
            prompts_per_step=B,
            root_rollouts_per_step=128,
            rollouts_per_prompt_max=8,
            continuations_per_prefix_max=2,
        )
        alloc = build_allocator(cfg, check=False, max_group_size=P)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            m = alloc.plan_roots(v_root, g)
            k = alloc.plan_prefixes(v, r, group, m, g)
            extra = alloc.plan_root_continuations(m, k, g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert int(m.sum() + k.sum() + extra.sum()) == alloc.trajectories_per_step, name
        assert alloc.metrics()["alloc/invalid_predictions"] == (1.0 if alloc.tree else 0.0)
