"""Is the policy-gradient step noise-limited, and does an allocator's batch carry more signal? The
gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training") of the
learning-per-trajectory demo at its warm start, per allocator.

Each (allocator, batch size B) is one `trace-mega train` run of `demo_headroom_cpu` from the cached
warm start with the policy frozen (`optim.lr` 1e-12): every step draws a fresh batch of B root
trajectories (groups of 4, the allocator choosing the prompts as in the demo's attempt-7 rule) at the
same weights, and logs its gradient's norm before clipping (`loss/grad_norm`). With G the expected
batch gradient of the allocator's sampling and S the per-trajectory trace of its covariance,

    E |g_B|^2 = |G|^2 + S / B,

fitted by least squares on 1/B over the batch sizes; B_simple = S / |G|^2 is the batch (in
trajectories) above which a larger batch stops buying a cleaner step. Intervals: 5-95% of a bootstrap
over each run's steps. The first `--skip` steps are left out (the predictor is not yet measured).

    python benchmarks/bench_grad_noise.py [--methods uniform,trace] [--batches 16,32,64,128] [--steps 300]
        [--out runs/grad_noise] [--jobs 2] [--json PATH]
    trace-mega bench grad_noise [same options]

A run directory that already holds `--steps` logged steps of the same command is reused.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import RESULTS, command_line, parser, print_table, write_json

FROZEN_LR = 1e-12  # OptimConfig needs lr > 0; Adam then moves each weight by ~1e-12 a step


def overrides(method: str, batch: int, steps: int, warm_start: str, run_dir: Path) -> list[str]:
    """The `trace-mega train` overrides of one (allocator, batch size) run."""
    return [
        f"allocation.name={method}",
        "seed=0",
        f"steps={steps}",
        f"optim.lr={FROZEN_LR}",
        "eval.every_steps=0",
        f"model.hf_checkpoint={warm_start}",
        f"allocation.root_rollouts_per_step={batch}",
        "allocation.continuations_per_rollout=0.0",
        "allocation.prompts_per_step=128",
        "allocation.rollouts_per_prompt_max=4",
        f"telemetry.out_dir={run_dir}",
        "telemetry.progress_bars=false",
        "telemetry.tensorboard=false",
    ]


def squared_norms(run_dir: Path, steps: int, skip: int) -> tuple[list[float], float]:
    """|g_B|^2 of steps skip..steps-1 of a run, and its mean contrasted groups per step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][skip:steps]
    return [r["loss/grad_norm"] ** 2 for r in rows], statistics.mean(r["alloc/contrasted_groups"] for r in rows)


def fit(batches: list[int], mean_sq: list[float]) -> tuple[float, float]:
    """(|G|^2, S): the least-squares line E|g_B|^2 = |G|^2 + S / B."""
    xs = [1.0 / b for b in batches]
    mx, my = statistics.mean(xs), statistics.mean(mean_sq)
    s = sum((x - mx) * (y - my) for x, y in zip(xs, mean_sq)) / sum((x - mx) ** 2 for x in xs)
    return my - s * mx, s


def bootstrap(batches: list[int], samples: list[list[float]], reps: int, seed: int = 0) -> dict[str, tuple]:
    """5-95% intervals of |G|^2, S and B_simple, resampling each batch size's steps."""
    rng = random.Random(seed)
    g2s, ss, bs = [], [], []
    for _ in range(reps):
        g2, s = fit(batches, [statistics.mean(rng.choices(v, k=len(v))) for v in samples])
        g2s.append(g2)
        ss.append(s)
        bs.append(s / g2 if g2 > 0 else float("inf"))

    def interval(v: list[float]) -> tuple[float, float]:
        v = sorted(v)
        return v[int(0.05 * len(v))], v[int(0.95 * len(v)) - 1]

    return {"G2": interval(g2s), "S": interval(ss), "B_simple": interval(bs)}


def run(method: str, batch: int, args, warm_start: str) -> Path:
    run_dir = Path(args.out) / f"{method}_{batch}"
    cmd = [sys.executable, "-m", "trace_mega", "train", "--config", "demo_headroom_cpu"]
    cmd += overrides(method, batch, args.steps, warm_start, run_dir)
    stamp = run_dir / "command.json"
    metrics = run_dir / "metrics.jsonl"
    if stamp.exists() and json.loads(stamp.read_text()) == cmd[3:] and metrics.exists():
        if len(metrics.read_text().splitlines()) >= args.steps:
            print(f"{run_dir}: reused")
            return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(run_dir / "train.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    stamp.write_text(json.dumps(cmd[3:]))
    return run_dir


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "grad_noise.json")
    ap.add_argument("--methods", default="uniform,trace", help="allocators, comma-separated")
    ap.add_argument("--batches", default="16,32,64,128", help="root trajectories per step, comma-separated")
    ap.add_argument("--steps", type=int, default=300, help="steps (batches) per run")
    ap.add_argument("--skip", type=int, default=10, help="first steps left out")
    ap.add_argument("--out", default="runs/grad_noise", help="the runs' directory")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    args = ap.parse_args(argv)
    from trace_mega.commands.demo import warm_start
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.resources import resolve_config

    methods, batches = args.methods.split(","), [int(b) for b in args.batches.split(",")]
    ckpt = warm_start(load_yaml(TrainConfig, resolve_config("demo_headroom_cpu")), resolve_config("pretrain_levels"))
    grid = [(m, b) for m in methods for b in batches]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = dict(zip(grid, pool.map(lambda mb: run(*mb, args, ckpt), grid)))
    rows, fits = [], {}
    for m in methods:
        samples = []
        for b in batches:
            sq, contrasted = squared_norms(dirs[m, b], args.steps, args.skip)
            samples.append(sq)
            se = statistics.stdev(sq) / len(sq) ** 0.5
            rows.append(dict(method=m, batch=b, mean_sq=statistics.mean(sq), se=se, contrasted=contrasted, n=len(sq)))
        g2, s = fit(batches, [statistics.mean(v) for v in samples])
        fits[m] = dict(G2=g2, S=s, B_simple=s / g2 if g2 > 0 else float("inf"))
        fits[m]["interval"] = bootstrap(batches, samples, args.bootstrap)
    print_table(
        rows,
        [("method", "method", "<"), ("batch", "B", "d"), ("mean_sq", "E|g_B|^2", ".4f"), ("se", "± se", ".4f"),
         ("contrasted", "contrasted groups", ".2f"), ("n", "batches", "d")],
        title="Gradient norms of fresh batches at the frozen warm start",
    )  # fmt: skip
    print_table(
        [dict(method=m, **{k: f[k] for k in ("G2", "S", "B_simple")}, **{
            f"{k}_ci": "[{:.4g}, {:.4g}]".format(*f["interval"][k]) for k in ("G2", "S", "B_simple")}) for m, f in fits.items()],
        [("method", "method", "<"), ("G2", "|G|^2", ".4f"), ("G2_ci", "5-95%", "<"), ("S", "S", ".3f"),
         ("S_ci", "5-95%", "<"), ("B_simple", "B_simple", ".0f"), ("B_simple_ci", "5-95%", "<")],
        title="E|g_B|^2 = |G|^2 + S/B; B_simple = S/|G|^2 trajectories",
    )  # fmt: skip
    result = {"command": command_line(__file__, argv), "warm_start": ckpt, "rows": rows, "fits": fits}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
