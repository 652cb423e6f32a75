"""Learning per trajectory of finished demo runs kept in different directories: the report
`trace-mega demo` writes for arms of one `--out`, for arms run apart (an attempt's new arm against
an earlier attempt's baselines, or an arm counted by the trajectories it kept).

Each `--arm NAME=GLOB` names run directories (one per seed, each with `metrics.jsonl`). The numbers are
the demo's (`trace_mega.commands.demo.learning`): the threshold is the `uniform` arm's seed-mean final
held-out eval (else `--threshold`); trajectories to it on the seed-mean curve and per seed; the eval AUC
up to the fewest trajectories any arm of that seed generated; the final eval. `--kept NAME` counts that
arm's trajectories by what its steps trained on (`alloc/trajectories`) instead of what they generated:
the axis of attempt 8's ceiling (docs/results/allocation.md). A second table gives forgetting per eval
group (a difficulty level): its best held-out eval minus its last, seed-mean (the demo's
`forgetting_per_group`), with the last eval beside it. `largest fall` is each seed's largest drop of the
held-out eval from one evaluation to the next: how far a run falls back before it recovers.

    python benchmarks/bench_learning_per_trajectory.py --arm 'uniform=runs/demo_levels_b16/uniform/seed*' \
        --arm 'trace=runs/demo_levels_b16_sampled/trace/seed*' [--kept NAME] [--threshold X]
    trace-mega bench learning_per_trajectory [same options]
"""

from __future__ import annotations

import glob
import json
import statistics
from pathlib import Path

from harness import RESULTS, command_line, parser, print_table, write_json


def load(pattern: str, kept: bool) -> list[list[dict]]:
    """Per run directory matching `pattern` (sorted), its metrics rows; with `kept`, every step's
    `alloc/generated_trajectories` replaced by the trajectories it trained on."""
    runs = []
    for d in sorted(glob.glob(pattern)):
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        if kept:
            rows = [r | {"alloc/generated_trajectories": r["alloc/trajectories"]} for r in rows]
        runs.append(rows)
    if not runs:
        raise SystemExit(f"no run directory matches {pattern!r}")
    return runs


def largest_fall(curve: list[tuple[float, float]]) -> float:
    """Largest drop of the eval reward between consecutive points of `curve` ([(trajectories, reward)]);
    0 when it never falls."""
    return max([0.0] + [a[1] - b[1] for a, b in zip(curve, curve[1:])])


def forgetting_table(runs: dict[str, list[list[dict]]], split: str) -> dict[str, dict[str, list[float]]]:
    """Per arm and eval group: [seed-mean drop from its best eval to its last, seed-mean last eval], printed
    as one row per arm (`drop / last` per group). Empty when the runs hold no per-group evaluation."""
    from trace_mega.commands.demo import forgetting, group_evals

    out: dict[str, dict[str, list[float]]] = {}
    for name, rs in runs.items():
        drops = [forgetting(r, split) for r in rs]
        last = [{g: v[-1] for g, v in group_evals(r, split).items()} for r in rs]
        out[name] = {
            g: [statistics.fmean(d[g] for d in drops), statistics.fmean(x[g] for x in last)]
            for g in sorted(set().union(*drops))
            if all(g in d for d in drops)
        }
    groups = sorted(set().union(*out.values()))
    if groups:
        rows = [
            {"arm": n} | {g: f"{v[0]:.3f} / {v[1]:.3f}" for g, v in by_group.items()} for n, by_group in out.items()
        ]
        print_table(rows, [("arm", "arm", "<")] + [(g, g, "<") for g in groups],
                    title="per eval group: largest drop from best to last eval / last eval (seed means)")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    from trace_mega.commands.demo import _mean_curve, eval_curve, first_reaching, learning

    ap = parser(__doc__, RESULTS / "learning_per_trajectory.json")
    ap.add_argument("--arm", action="append", required=True, help="NAME=GLOB of its seeds' run directories")
    ap.add_argument("--kept", action="append", default=[], help="an arm counted by its kept trajectories")
    ap.add_argument("--threshold", type=float, default=None, help="without a uniform arm: the eval reward to reach")
    ap.add_argument("--split", default="test", help="the evaluated split")
    args = ap.parse_args(argv)
    arms = dict(a.split("=", 1) for a in args.arm)
    runs = {name: load(pattern, name in args.kept) for name, pattern in arms.items()}
    seeds = {len(r) for r in runs.values()}
    if len(seeds) != 1:
        raise SystemExit(f"every arm needs the same number of seeds; got { {n: len(r) for n, r in runs.items()} }")
    table: dict[str, dict] = {name: {} for name in runs}
    threshold = learning(runs, table, args.split)
    if "uniform" not in runs and args.threshold is not None:
        threshold = args.threshold  # re-measure the arms against the given threshold
        for name, rs in runs.items():
            curves = [eval_curve(r, args.split) for r in rs]
            table[name]["trajectories_to_threshold"] = first_reaching(_mean_curve(curves), threshold)
            table[name]["trajectories_to_threshold_per_seed"] = [first_reaching(c, threshold) for c in curves]
    ref = table.get("uniform", {}).get("trajectories_to_threshold")
    rows = []
    for name, rs in runs.items():
        t = table[name]
        to = t["trajectories_to_threshold"]
        rows.append(
            dict(
                arm=name + (" (kept)" if name in args.kept else ""),
                seeds=len(rs),
                contrasted=statistics.fmean(statistics.fmean(r["alloc/contrasted_prompts"] for r in run) for run in rs),
                to=to,
                ratio=to / ref if to is not None and ref else None,
                per_seed=" / ".join(
                    "never" if x is None else f"{x:.0f}" for x in t["trajectories_to_threshold_per_seed"]
                ),
                auc=t["eval_auc"],
                final=statistics.fmean(t["eval_reward_final_per_seed"]),
                final_per_seed=" / ".join(f"{x:.3f}" for x in t["eval_reward_final_per_seed"]),
                falls=" / ".join(f"{largest_fall(eval_curve(r, args.split)):.3f}" for r in rs),
                fallback=" / ".join(f"{sum(r.get('alloc/fallback', 0.0) for r in run):.0f}" for run in rs),
            )
        )
    print_table(
        rows,
        [("arm", "arm", "<"), ("seeds", "seeds", "d"), ("contrasted", "contrasted groups / step", ".2f"),
         ("to", "trajectories to threshold", ".0f"), ("ratio", "x uniform's", ".2f"), ("per_seed", "per seed", "<"),
         ("auc", "eval AUC", ".3f"), ("final", "final", ".3f"), ("final_per_seed", "per seed", "<"),
         ("falls", "largest fall", "<"), ("fallback", "fallback steps", "<")],
        title=f"threshold {threshold:.4f} (held-out eval)" if threshold is not None else "no held-out evaluation",
    )  # fmt: skip
    levels = forgetting_table(runs, args.split)
    curves = {
        name: [[round(x), round(y, 4)] for x, y in table[name]["eval_curve"]]
        for name in runs
        if "eval_curve" in table[name]
    }
    result = {
        "command": command_line(__file__, argv),
        "threshold": threshold,
        "rows": rows,
        "curves": curves,
        "forgetting": levels,
    }
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
