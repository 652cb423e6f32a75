"""The tree simulator's ground truth, the predictors, and the step metrics."""

import pytest
import torch

from trace_mega.allocation import build_allocator
from trace_mega.config import AllocationConfig
from trace_mega.sim import (
    LearnedPredictor,
    NoisyPredictor,
    OraclePredictor,
    SimConfig,
    TreeSimulator,
    build_predictor,
    run_allocator,
    simulate_step,
    summarize,
)


def test_prompt_prior_is_u_shaped_and_seeded():
    p = TreeSimulator(seed=0).sample_prompts(20000).p
    assert bool(((p >= 0) & (p <= 1)).all())
    edges = ((p < 0.1) | (p > 0.9)).float().mean()
    middle = ((p > 0.4) & (p < 0.6)).float().mean()
    assert edges > 0.5 and middle < 0.12  # most mass near 0 and 1 (Beta(0.3, 0.3): 0.59 and 0.08)
    assert torch.equal(p, TreeSimulator(seed=0).sample_prompts(20000).p)
    assert not torch.equal(p, TreeSimulator(seed=1).sample_prompts(20000).p)


def test_prefix_values_are_the_conditional_success_probability():
    sim = TreeSimulator(SimConfig(turns=5), seed=1)
    prompts = sim.sample_prompts(400)
    ro = sim.bare_rollouts(prompts, torch.full((400,), 50))
    V, r = ro.values, ro.reward
    assert set(r.unique().tolist()) <= {0.0, 1.0}
    assert bool(((V >= 0) & (V <= 1)).all()) and torch.equal(V[:, 0], prompts.p[ro.prompt])
    # E[r | V_t in bin] = mean V_t in the bin, at every depth (calibration of the ground truth).
    for t in range(5):
        bins = torch.clamp((V[:, t] * 10).long(), max=9)
        for b in range(10):
            sel = bins == b
            if int(sel.sum()) > 2000:
                assert abs(float(r[sel].mean() - V[sel, t].mean())) < 0.02
    # Martingale step: E[V_{t+1} - V_t] = 0.
    assert abs(float((V[:, 2] - V[:, 1]).mean())) < 0.005


def test_prefixes_and_continuations():
    sim = TreeSimulator(SimConfig(turns=4), seed=2)
    prompts = sim.sample_prompts(3)
    m = torch.tensor([2, 0, 3])
    ro = sim.bare_rollouts(prompts, m)
    pre = sim.prefixes(ro)
    assert pre.group.tolist() == [0] * 6 + [2] * 9 and pre.depth.tolist()[:3] == [1, 2, 3]
    assert torch.equal(pre.value, ro.values[pre.rollout, pre.depth])
    assert torch.equal(pre.reward, ro.reward[pre.rollout])
    big = sim.bare_rollouts(sim.sample_prompts(200), torch.full((200,), 5))
    bp = sim.prefixes(big)
    K = torch.full_like(bp.group, 40)
    succ = sim.continue_from(bp, K)
    assert bool((succ <= 40).all()) and abs(float(succ.sum() / (40 * bp.value.sum())) - 1) < 0.02
    assert int(sim.continue_from(bp, torch.zeros_like(K)).sum()) == 0


def test_noisy_predictor_is_calibrated_at_roots():
    prompts = TreeSimulator(seed=3).sample_prompts(40000)
    for noise in (0.3, 0.6):
        v = NoisyPredictor(noise, seed=0).predict_roots(prompts)
        for level in v.unique():
            sel = v == level
            if int(sel.sum()) > 1500:
                assert abs(float(prompts.p[sel].mean() - level)) < 0.02
    assert torch.equal(NoisyPredictor(0.0).predict_roots(prompts), prompts.p)
    assert torch.allclose(NoisyPredictor(1.0).predict_roots(prompts), torch.full_like(prompts.p, 0.5))
    with pytest.raises(ValueError):
        NoisyPredictor(1.5)
    with pytest.raises(KeyError, match="valid"):
        build_predictor("psychic")


def _cfg(name):
    return AllocationConfig(
        name=name,
        prompts_per_step=128,
        root_rollouts_per_step=128,
        rollouts_per_prompt_max=8,
        group_size=4,
        continuations_per_rollout=1.0,
    )


def test_step_metrics_match_a_direct_recount():
    sim = TreeSimulator(seed=4)
    res = simulate_step(sim, build_allocator(_cfg("trace")), OraclePredictor(), 128, torch.Generator().manual_seed(0))
    met = res.metrics
    assert met["trajectories"] == 256 and int(res.m.sum()) == 128 and int(res.K.sum()) == 128
    active = res.m > 0
    mixed = (res.prompt_successes > 0) & (res.prompt_successes < res.prompt_leaves)
    assert met["active_prompts"] == int(active.sum()) and met["contrasted_prompts"] == int((active & mixed).sum())
    assert met["effective_ratio"] == pytest.approx(met["contrasted_prompts"] / met["active_prompts"])
    assert (
        met["branch_points"] == int((res.K > 0).sum()) and 0 <= met["contrasted_branch_groups"] <= met["branch_points"]
    )


def test_branch_group_count_by_brute_force():
    sim = TreeSimulator(SimConfig(turns=3), seed=5)
    alloc = build_allocator(
        AllocationConfig(
            name="treepo", prompts_per_step=8, root_rollouts_per_step=8, group_size=2, continuations_per_rollout=2.0
        )
    )
    # Re-run the step's random draws by hand with an identical simulator to recount the trees.
    twin = TreeSimulator(SimConfig(turns=3), seed=5)
    res = simulate_step(sim, alloc, OraclePredictor(), 8, torch.Generator().manual_seed(1))
    prompts = twin.sample_prompts(8)
    ro = twin.bare_rollouts(prompts, res.m)
    pre = twin.prefixes(ro)
    succ = twin.continue_from(pre, res.K).tolist()
    count = 0
    for p in range(pre.group.numel()):
        if res.K[p] == 0:
            continue
        j, t = int(pre.rollout[p]), int(pre.depth[p])
        deeper = [q for q in range(pre.group.numel()) if int(pre.rollout[q]) == j and int(pre.depth[q]) >= t]
        n = 1 + sum(int(res.K[q]) for q in deeper)
        s = int(ro.reward[j]) + sum(succ[q] for q in deeper)
        count += 0 < s < n
    assert res.metrics["contrasted_branch_groups"] == count


def test_trace_beats_uniform_with_oracle_and_learned_predictor_improves():
    sim_cfg = SimConfig()
    out = {}
    for name in ("uniform", "trace"):
        steps = run_allocator(build_allocator(_cfg(name)), OraclePredictor, TreeSimulator(sim_cfg, seed=6), 5, 128)
        out[name] = summarize(steps)
    assert out["trace"]["effective_ratio"] > 1.5 * out["uniform"]["effective_ratio"]
    assert out["trace"]["effective_ratio_ci95"][0] <= out["trace"]["effective_ratio"]
    learned = LearnedPredictor(seed=0)
    steps = run_allocator(build_allocator(_cfg("trace")), lambda: learned, TreeSimulator(sim_cfg, seed=7), 8, 128)
    assert steps[-1]["root_mse"] < 0.5 * steps[0]["root_mse"]  # online learning from the trees
    assert 0 < steps[-1]["prefix_sample_fraction"] < 1
