"""Does V(1-V) starve rare-success prompts? Rollouts per prompt by true success rate, in the simulator.

The seed papers' open question: TRACE-A's root gain 1 - v^m - (1-v)^m is small at
v ≈ 1/8, so a prompt that succeeds once in eight tries may get no rollouts at all,
while it is exactly where a policy still has something to learn. On the ground-truth
simulator (`trace_mega.sim`, the allocation benchmark's step: 256 candidates, 256 root
rollouts of at most 8 per prompt, N = 1), with the exact (`oracle`) and the noisy
predictor, each allocator's plan is bucketed by the prompt's TRUE success p:

* `rare` — p in [1/16, 3/16) (≈ 1 success in 8), `mid` — p in [0.25, 0.75];
* `served` — share of the bucket's prompts given >= 1 trajectory;
* `traj` — mean trajectories (roots + continuations) per prompt of the bucket;
* `contrasted` — share of the bucket's prompts whose trees hold a success and a failure;
* `eff` — the whole step's effective ratio (contrasted / active prompts).

`exploration` rows set `allocation.exploration_fraction`: that share of the root budget goes,
2 rollouts each, to random prompts before the solver spends the rest.

    python benchmarks/bench_rare_successes.py [--steps 200] [--seeds 3] [--json PATH]
    trace-mega bench rare_successes [same options]
"""

from __future__ import annotations

import statistics

import torch
from harness import RESULTS, command_line, parser, print_table, write_json

from trace_mega.allocation import build_allocator
from trace_mega.config import AllocationConfig
from trace_mega.sim import SimConfig, TreeSimulator, build_predictor
from trace_mega.sim.run import simulate_step

BUCKETS = {"rare": (1 / 16, 3 / 16), "mid": (0.25, 0.75)}


def _config(name: str, exploration: float = 0.0) -> AllocationConfig:
    return AllocationConfig(
        name=name,
        prompts_per_step=256,
        root_rollouts_per_step=256,
        rollouts_per_prompt_max=8,
        group_size=4,
        continuations_per_rollout=1.0,
        exploration_fraction=exploration,
    )


def measure(name: str, predictor: str, steps: int, seed: int, exploration: float = 0.0) -> dict[str, float]:
    """Per bucket: served share, trajectories per prompt, contrasted share (pooled over steps)."""
    sim_cfg = SimConfig()
    sim, alloc = TreeSimulator(sim_cfg, seed=seed), build_allocator(_config(name, exploration))
    pred = build_predictor(predictor, 0.5, sim_cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seen: list[torch.Tensor] = []
    draw = sim.sample_prompts

    def recording(B):  # the step's prompts, to bucket its plan by the true p
        prompts = draw(B)
        seen.append(prompts.p)
        return prompts

    sim.sample_prompts = recording
    tot = {b: [0, 0, 0.0, 0] for b in BUCKETS}  # prompts, served, trajectories, contrasted
    eff = []
    for _ in range(steps):
        res = simulate_step(sim, alloc, pred, 256, gen)
        eff.append(res.metrics["effective_ratio"])
        p = seen[-1]
        n = res.prompt_leaves
        contrasted = (n > 0) & (res.prompt_successes > 0) & (res.prompt_successes < n)
        for b, (lo, hi) in BUCKETS.items():
            sel = (p >= lo) & (p < hi) if b == "rare" else (p >= lo) & (p <= hi)
            t = tot[b]
            t[0] += int(sel.sum())
            t[1] += int((sel & (n > 0)).sum())
            t[2] += float(n[sel].sum())
            t[3] += int((sel & contrasted).sum())
    out = {"effective_ratio": statistics.fmean(eff)}
    for b, (count, served, traj, con) in tot.items():
        out |= {
            f"{b}_served": served / max(count, 1),
            f"{b}_traj": traj / max(count, 1),
            f"{b}_contrasted": con / max(count, 1),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "bench_rare_successes.json")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    runs = {
        "uniform": ("uniform", "oracle", 0.0),
        "treepo": ("treepo", "oracle", 0.0),
        "trace (oracle)": ("trace", "oracle", 0.0),
        "trace (noisy 0.5)": ("trace", "noisy", 0.0),
        "trace (oracle), exploration 0.125": ("trace", "oracle", 0.125),
        "trace (oracle), exploration 0.25": ("trace", "oracle", 0.25),
    }
    rows = []
    for label, (name, predictor, exploration) in runs.items():
        per = [measure(name, predictor, args.steps, s, exploration) for s in range(args.seeds)]
        rows.append(
            {
                "allocator": label,
                "exploration_fraction": exploration,
                **{k: statistics.fmean(p[k] for p in per) for k in per[0]},
            }
        )
    cols = [("allocator", "allocator", "<"), ("effective_ratio", "eff", ".3f")]
    for b in BUCKETS:
        cols += [
            (f"{b}_served", f"{b} served", ".3f"),
            (f"{b}_traj", f"{b} traj", ".2f"),
            (f"{b}_contrasted", f"{b} contrasted", ".3f"),
        ]
    print_table(
        rows,
        cols,
        title=f"simulator, {args.steps} steps x {args.seeds} seeds; buckets by true p: "
        "rare [1/16, 3/16), mid [0.25, 0.75]",
    )
    result = {"command": command_line(__file__, argv), "rows": rows}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
