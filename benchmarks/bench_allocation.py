"""Benchmark: TRACE-A allocators on the ground-truth simulator, and the solvers' speed.

1. Allocators at equal budget (uniform, pcl, treepo, trace, trace_global) ×
   predictors (oracle, noisy, learned), over `--steps` seeded steps each:
   effective ratio (contrasted / active prompts, the paper's denominator) with
   a 95% interval over steps, contrasted prompts and contrasted branch-point
   groups per step, and trajectories spent per step.
2. Effective ratio against predictor noise (the calibrated noisy predictor,
   noise 0 = oracle and 1 = no information), saved as a PNG.
3. Solver speed on this machine, in process CPU seconds (one thread). The root problem has B = 4,096,
   max_rollouts = 16 and budget = 32,768. The prefix problem has 100,000
   prefixes in 4,096 groups. Each runs as the batched solver, the exact DP
   reference and a plain-Python greedy, printed as ratios, with the
   objectives checked equal.

    python benchmarks/bench_allocation.py [--steps 20] [--quick] [--json PATH] [--png PATH]   ('' = skip)
    trace-mega bench allocation [same options]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS, parser, print_table, timed, timeit, write_json

from trace_mega.allocation import allocate_prefixes, allocate_roots, build_allocator
from trace_mega.config import AllocationConfig
from trace_mega.kernels.allocation_ref import (
    prefix_objective,
    prefixes_dp,
    prefixes_greedy_python,
    root_objective,
    roots_dp,
    roots_greedy_python,
)
from trace_mega.sim import SimConfig, TreeSimulator, build_predictor, run_allocator, summarize

ALLOCATOR_NAMES = ["uniform", "pcl", "treepo", "trace", "trace_global"]
PREDICTORS = ["oracle", "noisy", "learned"]
NOISY_DEFAULT = 0.5  # n = 3 pseudo-rollouts
NOISE_LEVELS = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]


def sim_allocation_config(name: str) -> AllocationConfig:
    """The benchmark's step: 256 candidates, 256 root rollouts (<= 8 each), N = 1, group size 4."""
    return AllocationConfig(
        name=name,
        prompts_per_step=256,
        root_rollouts_per_step=256,
        rollouts_per_prompt_max=8,
        group_size=4,
        continuations_per_rollout=1.0,
    )


def run_table(steps: int, seed: int) -> dict:
    """allocator -> predictor -> summary over `steps` steps (same prompt pools for every allocator)."""
    sim_cfg = SimConfig()
    out: dict = {}
    for name in ALLOCATOR_NAMES:
        cfg = sim_allocation_config(name)
        out[name] = {}
        for pk in PREDICTORS:
            per_step = run_allocator(
                build_allocator(cfg),
                lambda: build_predictor(pk, NOISY_DEFAULT, sim_cfg, seed=seed),
                TreeSimulator(sim_cfg, seed=seed),
                steps,
                cfg.prompts_per_step,
                seed=seed,
            )
            out[name][pk] = summarize(per_step)
    return out


def run_noise_curve(steps: int, seed: int, levels: list[float]) -> dict:
    """allocator -> list of (noise, effective ratio, ci95) with the calibrated noisy predictor."""
    sim_cfg = SimConfig()
    curve: dict = {}
    for name in ALLOCATOR_NAMES:
        cfg = sim_allocation_config(name)
        curve[name] = []
        for noise in levels:
            s = summarize(
                run_allocator(
                    build_allocator(cfg),
                    lambda: build_predictor("noisy", noise, sim_cfg, seed),
                    TreeSimulator(sim_cfg, seed=seed),
                    steps,
                    cfg.prompts_per_step,
                    seed=seed,
                )
            )
            curve[name].append(
                {"noise": noise, "effective_ratio": s["effective_ratio"], "ci95": s["effective_ratio_ci95"]}
            )
    return curve


# Solver speed is process CPU time: everything here runs on one thread, and on a shared
# machine CPU time is a fairer measure than wall time, which counts waiting for other jobs.
CLOCK = "process"


def run_solver_speed(quick: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    B, Mmax, M = (512, 16, 4096) if quick else (4096, 16, 32768)
    v = rng.beta(0.3, 0.3, B)
    vt = torch.tensor(v)
    t_batched = timeit(lambda: allocate_roots(vt, M, Mmax), reps=5, clock=CLOCK)
    m = allocate_roots(vt, M, Mmax).numpy()
    (_, dp_obj), t_dp = timed(lambda: roots_dp(v, M, Mmax), clock=CLOCK)
    m_py, t_py = timed(lambda: roots_greedy_python(v, M, Mmax), clock=CLOCK)
    roots = {
        "B": B,
        "max_rollouts": Mmax,
        "budget": M,
        "batched_s": t_batched,
        "dp_s": t_dp,
        "python_s": t_py,
        "objective_gap_vs_dp": abs(root_objective(v, m) - dp_obj),
        "python_objective_gap_vs_dp": abs(root_objective(v, m_py) - dp_obj),
    }

    P, G = (10_000, 512) if quick else (100_000, 4096)
    group = np.sort(rng.integers(0, G, P))
    pv = rng.random(P)
    r = (rng.random(P) < pv).astype(np.int64)
    budget = rng.integers(0, 17, G)  # m_g * N with N = 1, mean 8
    args = [torch.tensor(x) for x in (pv, r, group, budget)]
    t_pb = timeit(lambda: allocate_prefixes(*args), reps=3, clock=CLOCK)
    k = allocate_prefixes(*args).numpy()
    k_py, t_ppy = timed(lambda: prefixes_greedy_python(pv, r, group, budget), clock=CLOCK)
    (_, pdp_obj), t_pdp = timed(lambda: prefixes_dp(pv, r, group, budget), clock=CLOCK)
    prefixes = {
        "P": P,
        "groups": G,
        "budget_total": int(budget.sum()),
        "batched_s": t_pb,
        "dp_s": t_pdp,
        "python_s": t_ppy,
        "objective_gap_vs_dp": abs(prefix_objective(pv, r, k) - pdp_obj),
        "python_objective_gap_vs_dp": abs(prefix_objective(pv, r, k_py) - pdp_obj),
    }
    return {
        "roots": roots,
        "prefixes": prefixes,
        "roots_speedup_vs_dp": t_dp / t_batched,
        "roots_speedup_vs_python": t_py / t_batched,
        "prefixes_speedup_vs_dp": t_pdp / t_pb,
        "prefixes_speedup_vs_python": t_ppy / t_pb,
    }


def plot_noise_curve(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, pts in curve.items():
        x = [p["noise"] for p in pts]
        y = [p["effective_ratio"] for p in pts]
        err = [[p["effective_ratio"] - p["ci95"][0] for p in pts], [p["ci95"][1] - p["effective_ratio"] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xlabel("predictor noise (1/sqrt(1 + pseudo-rollouts); 0 = oracle, 1 = uninformed)")
    ax.set_ylabel("effective ratio (contrasted / active prompts)")
    ax.set_title("TRACE-A allocators at equal budget vs predictor noise")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(table: dict, solver: dict) -> None:
    rows = [
        {"allocator": name, "predictor": pk, **s, "ci": "[{:.3f}, {:.3f}]".format(*s["effective_ratio_ci95"])}
        for name, per in table.items()
        for pk, s in per.items()
    ]
    print_table(
        rows,
        title=f"\nAllocators at equal budget (noisy predictor: noise {NOISY_DEFAULT}); "
        "per step means, 95% CI over steps",
        cols=[
            ("allocator", "allocator", "<"),
            ("predictor", "predictor", "<"),
            ("effective_ratio", "eff. ratio", ".3f"),
            ("ci", "95% CI", ""),
            ("contrasted_prompts", "contrasted", ".1f"),
            ("active_prompts", "active", ".1f"),
            ("contrasted_branch_groups", "contr. BP", ".1f"),
            ("trajectories", "traj", ".0f"),
        ],
    )
    base = table["uniform"]["oracle"]["effective_ratio"]
    print(f"\ntrace / uniform effective ratio (oracle): {table['trace']['oracle']['effective_ratio'] / base:.2f}x")
    ro, pr = solver["roots"], solver["prefixes"]
    rows = [
        {
            "problem": f"roots B={ro['B']} Mmax={ro['max_rollouts']} budget={ro['budget']}",
            **ro,
            "vs_dp": solver["roots_speedup_vs_dp"],
            "vs_python": solver["roots_speedup_vs_python"],
        },
        {
            "problem": f"prefixes P={pr['P']} groups={pr['groups']} budget={pr['budget_total']}",
            **pr,
            "vs_dp": solver["prefixes_speedup_vs_dp"],
            "vs_python": solver["prefixes_speedup_vs_python"],
        },
    ]
    print_table(
        rows,
        title=f"\nSolver speed (CPU seconds, {torch.get_num_threads()} torch thread(s); "
        "median of 5 / 3 runs for batched)",
        cols=[
            ("problem", "problem", "<"),
            ("batched_s", "batched s", ".4f"),
            ("dp_s", "DP s", ".2f"),
            ("python_s", "Python s", ".3f"),
            ("vs_dp", "vs DP", ".0f"),
            ("vs_python", "vs Python", ".1f"),
            ("objective_gap_vs_dp", "gap vs DP", ".1e"),
        ],
    )


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "allocation.json")
    ap.add_argument(
        "--steps", type=int, default=20, help="seeded steps per allocator and predictor (>= 20 for the report)"
    )
    ap.add_argument("--quick", action="store_true", help="5 steps, 3 noise levels, smaller solver problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default=str(RESULTS / "allocation_noise.png"), help="effective ratio vs noise plot")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    steps = 5 if args.quick else args.steps
    levels = [0.0, 0.5, 1.0] if args.quick else NOISE_LEVELS
    t0 = time.perf_counter()
    table = run_table(steps, args.seed)
    curve = run_noise_curve(steps, args.seed, levels)
    solver = run_solver_speed(args.quick, args.seed)
    allocators = {
        name: {
            "effective_ratio": per["oracle"]["effective_ratio"],
            "effective_ratio_ci95": per["oracle"]["effective_ratio_ci95"],
            "contrasted_prompts": per["oracle"]["contrasted_prompts"],
            "contrasted_branch_groups": per["oracle"]["contrasted_branch_groups"],
            "trajectories": per["oracle"]["trajectories"],
            "by_predictor": per,
        }
        for name, per in table.items()
    }
    result = {
        "config": {
            "steps": steps,
            "seed": args.seed,
            "quick": args.quick,
            "noisy_noise": NOISY_DEFAULT,
            "allocation": sim_allocation_config("trace").__dict__,
            "sim": SimConfig().__dict__,
            "effective_ratio_denominator": "active prompts (given >= 1 rollout)",
        },
        "allocators": allocators,
        "trace_over_uniform_oracle": allocators["trace"]["effective_ratio"] / allocators["uniform"]["effective_ratio"],
        "noise_curve": curve,
        "solver": solver,
    }
    print_tables(table, solver)
    print()
    write_json(result, args.json)
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot_noise_curve(curve, Path(args.png))
        print(f"wrote {args.png}")
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return result


if __name__ == "__main__":
    main()
