"""One simulated TRACE-A step (docs/design.md §3.4 steps 1-10) for any allocator, and seeded multi-step runs.

Metrics per step. The effective ratio's denominator is the active prompts
(those given >= 1 rollout), which is the paper's:
* `active_prompts`, `contrasted_prompts` (tree has a success leaf and a
  failure leaf), `effective_ratio` = contrasted / active;
* `branch_points` (prefixes with K >= 1) and `contrasted_branch_groups`
  (branch points whose leaves below hold both outcomes);
* `trajectories` = root rollouts + continuations (equal for all allocators);
* `root_mse`, `prefix_mse`: the predictor's squared error against the true V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from trace_mega.allocation.allocators import Allocator
from trace_mega.sim.predictors import Predictor, TrainingData
from trace_mega.sim.simulator import TreeSimulator

__all__ = ["StepResult", "simulate_step", "run_allocator", "summarize"]


@dataclass
class StepResult:
    """Everything one step produced: the plan, the trees' outcomes and the metrics."""

    m: torch.Tensor
    K: torch.Tensor
    prompt_successes: torch.Tensor
    prompt_leaves: torch.Tensor
    metrics: dict


def simulate_step(
    sim: TreeSimulator, allocator: Allocator, predictor: Predictor, prompts_per_step: int, generator: torch.Generator
) -> StepResult:
    """Predict, allocate roots, roll out, predict prefixes, allocate continuations, branch, update."""
    prompts = sim.sample_prompts(prompts_per_step)
    v_root = predictor.predict_roots(prompts)
    m = allocator.plan_roots(v_root, generator)  # (B,)
    ro = sim.bare_rollouts(prompts, m)
    pre = sim.prefixes(ro)
    v_pre = predictor.predict_prefixes(prompts, pre)
    K = allocator.plan_prefixes(v_pre, pre.reward.long(), pre.group, m, generator)  # (P,)
    succ = sim.continue_from(pre, K)  # (P,)

    B, R, T = m.numel(), ro.prompt.numel(), sim.cfg.turns
    reward = ro.reward.long()
    s_prompt = torch.zeros(B, dtype=torch.long).index_add_(0, ro.prompt, reward).index_add_(0, pre.group, succ)
    n_prompt = m + torch.zeros(B, dtype=torch.long).index_add_(0, pre.group, K)
    active = m > 0
    contrasted = active & (s_prompt > 0) & (s_prompt < n_prompt)
    # Leaves under prefix (j, t): the bare leaf of j plus continuations from (j, t') for t' >= t.
    K_tab, S_tab = K.view(R, T - 1), succ.view(R, T - 1)
    n_under = 1 + K_tab.flip(1).cumsum(1).flip(1)  # (R, T-1)
    s_under = reward[:, None] + S_tab.flip(1).cumsum(1).flip(1)
    branch = K_tab > 0
    bp_contrast = branch & (s_under > 0) & (s_under < n_under)

    root_index = torch.nonzero(active).squeeze(1)
    data = TrainingData(
        root_index=root_index,
        root_target=(s_prompt / n_prompt.clamp(min=1))[root_index],
        prefix_target=(s_under / n_under).reshape(-1),
        prompts=prompts,
        prefixes=pre,
    )
    n_active = int(active.sum())
    metrics = {
        "active_prompts": n_active,
        "contrasted_prompts": int(contrasted.sum()),
        "effective_ratio": int(contrasted.sum()) / n_active if n_active else 0.0,
        "branch_points": int(branch.sum()),
        "contrasted_branch_groups": int(bp_contrast.sum()),
        "trajectories": int(m.sum() + K.sum()),
        "root_mse": float(((v_root.double() - prompts.p) ** 2).mean()),
        "prefix_mse": float(((v_pre.double() - pre.value) ** 2).mean()) if pre.value.numel() else 0.0,
    }
    metrics.update(predictor.update(data))
    return StepResult(m=m, K=K, prompt_successes=s_prompt, prompt_leaves=n_prompt, metrics=metrics)


def run_allocator(
    allocator: Allocator,
    make_predictor: Callable[[], Predictor],
    sim: TreeSimulator,
    steps: int,
    prompts_per_step: int,
    seed: int = 0,
) -> list[dict]:
    """`steps` seeded steps of one allocator with a fresh predictor; returns the per-step metrics."""
    predictor = make_predictor()
    gen = torch.Generator().manual_seed(seed)
    return [simulate_step(sim, allocator, predictor, prompts_per_step, gen).metrics for _ in range(steps)]


def summarize(per_step: list[dict]) -> dict:
    """Means over steps, plus a 95% normal-approximation interval for the effective ratio."""
    n = len(per_step)
    out = {k: sum(s[k] for s in per_step) / n for k in per_step[0] if isinstance(per_step[0][k], (int, float))}
    er = [s["effective_ratio"] for s in per_step]
    sd = math.sqrt(sum((x - out["effective_ratio"]) ** 2 for x in er) / max(n - 1, 1))
    half = 1.96 * sd / math.sqrt(n)
    out["effective_ratio_ci95"] = [out["effective_ratio"] - half, out["effective_ratio"] + half]
    out["steps"] = n
    return out
