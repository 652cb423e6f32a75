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
held-out eval from one evaluation to the next: how far a run falls back before it recovers. A third table,
where the runs log them (`alloc/group/<g>/contrasted_prompts`), gives each arm's contrasted prompts a step
per eval group from step `--from-step` on, seed means: which prompts an allocator spends its contrast on; a
fourth the contrasted share of the prompts held per group: how well its picks within a level contrast.
`--ceiling` adds, for an environment with an exact best success (`greedy_success`: `synthetic_levels`),
each group's ceiling on the evaluated split and each arm's headroom left, ceiling minus last eval: a group at
its ceiling has contrasted groups from the environment's own randomness alone, nothing a policy can learn.
`interval` is a percentile bootstrap over seeds of an arm's trajectories to the threshold divided by
uniform's (`--versus A/B`: A's divided by B's): every draw resamples the seed indices with replacement,
the same indices for every arm (seed k of every arm shares its warm start and prompt order), and
recomputes the seed-mean curves and uniform's threshold from them. An arm that never reaches the
threshold in a draw counts as infinitely slow there.

    python benchmarks/bench_learning_per_trajectory.py --arm 'uniform=runs/demo_levels_b16/uniform/seed*' \
        --arm 'trace=runs/demo_levels_b16_sampled/trace/seed*' [--kept NAME] [--threshold X] [--versus trace/dapo]
    trace-mega bench learning_per_trajectory [same options]
"""

from __future__ import annotations

import glob
import json
import math
import random
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


def bootstrap_ratios(
    curves: dict[str, list[list[list[float]]]],
    pairs: list[tuple[str, str]],
    threshold: float | None,
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.9,
) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (A, B) of `pairs`: the central `level` interval of A's trajectories to the threshold over B's,
    each draw resampling the seed indices with replacement (the same indices for every arm) and
    recomputing the seed-mean curves. The threshold is uniform's resampled seed-mean final, or the fixed
    `threshold` when given. A never reaching it counts as inf, B never reaching it as 0; draws where
    neither does are left out. (nan, nan) when every draw is."""
    from trace_mega.commands.demo import _mean_curve, first_reaching

    n = len(next(iter(curves.values())))
    rng = random.Random(seed)
    ratios: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        mean = {arm: _mean_curve([cs[i] for i in idx]) for arm, cs in curves.items()}
        bar = threshold if threshold is not None else statistics.fmean(curves["uniform"][i][-1][1] for i in idx)
        for a, b in pairs:
            ta, tb = first_reaching(mean[a], bar), first_reaching(mean[b], bar)
            if ta is None and tb is None:
                continue
            ratios[(a, b)].append(math.inf if ta is None else 0.0 if tb is None else ta / tb)
    out = {}
    for p, xs in ratios.items():
        xs.sort()
        if not xs:
            out[p] = (math.nan, math.nan)
            continue
        tail = (1 - level) / 2
        out[p] = (xs[int(tail * (len(xs) - 1))], xs[math.ceil((1 - tail) * (len(xs) - 1))])
    return out


def _interval(lo_hi: tuple[float, float]) -> str:
    return "[" + ", ".join("never" if math.isinf(x) else f"{x:.2f}" for x in lo_hi) + "]"


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


def composition_table(runs: dict[str, list[list[dict]]], from_step: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per arm and eval group, over the steps >= `from_step`, seed means: `contrasted`, the contrasted prompts a
    step (a group a step does not hold counts 0 there), and `share`, the contrasted share of the prompts the steps
    held there (how well an allocator's picks within a level turn out contrasted; an arm that drops groups, dapo,
    counts the prompts it kept). Printed as one row per arm each; empty when no run logs per-group counts."""
    out: dict[str, dict[str, dict[str, float]]] = {"contrasted": {}, "share": {}}
    for name, rs in runs.items():
        per_seed, shares = [], []
        for rows in rs:
            steps = [r for r in rows if r["step"] >= from_step]
            keys = {k.split("/")[2] for r in steps for k in r if k.startswith("alloc/group/")}
            if not keys:  # a run from before the per-group counts: it says nothing, not 0
                continue
            held = {g: sum(r.get(f"alloc/group/{g}/prompts", 0.0) for r in steps) for g in keys}
            hit = {g: sum(r.get(f"alloc/group/{g}/contrasted_prompts", 0.0) for r in steps) for g in keys}
            per_seed.append({g: hit[g] / max(len(steps), 1) for g in keys})
            shares.append({g: hit[g] / held[g] for g in keys if held[g]})
        groups = sorted(set().union(*per_seed))
        if groups:
            out["contrasted"][name] = {g: statistics.fmean(s.get(g, 0.0) for s in per_seed) for g in groups}
            out["share"][name] = {
                g: statistics.fmean(s[g] for s in shares if g in s) for g in groups if any(g in s for s in shares)
            }
    groups = sorted(set().union(*out["contrasted"].values()))
    if groups:
        rows = [{"arm": n} | by_group | {"all": sum(by_group.values())} for n, by_group in out["contrasted"].items()]
        print_table(rows, [("arm", "arm", "<")] + [(g, g, ".2f") for g in groups] + [("all", "all", ".2f")],
                    title=f"contrasted prompts / step per eval group, steps >= {from_step} (seed means)")  # fmt: skip
        rows = [{"arm": n} | by_group for n, by_group in out["share"].items()]
        print_table(rows, [("arm", "arm", "<")] + [(g, g, ".2f") for g in groups],
                    title=f"contrasted share of the prompts held per eval group, steps >= {from_step} (seed means)")  # fmt: skip
    return out


def ceiling_table(first_run: str, levels: dict[str, dict[str, list[float]]], split: str) -> dict[str, float]:
    """Per eval group: the mean exact best success over the split's tasks, for the env and turn budget of
    `first_run`'s config.yaml, printed with each arm's headroom (ceiling - seed-mean last eval)."""
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.envs import build_env
    from trace_mega.evaluation import group_of

    cfg = load_yaml(TrainConfig, Path(first_run) / "config.yaml")
    env = build_env(cfg.env.name, **cfg.env.options)
    if not hasattr(env, "greedy_success"):
        raise SystemExit(f"--ceiling: env {cfg.env.name!r} has no exact best success (greedy_success)")
    by_group: dict[str, list[float]] = {}
    for task in env.tasks(split):
        by_group.setdefault(group_of(task.meta), []).append(env.greedy_success(task, cfg.rollout.max_turns))
    ceiling = {g: statistics.fmean(v) for g, v in sorted(by_group.items())}
    rows = [{"arm": "ceiling"} | {g: f"{c:.3f}" for g, c in ceiling.items()}]
    rows += [
        {"arm": n} | {g: f"{ceiling[g] - v[1]:+.3f}" for g, v in by.items() if g in ceiling} for n, by in levels.items()
    ]
    print_table(rows, [("arm", "arm", "<")] + [(g, g, "<") for g in ceiling],
                title=f"exact ceiling per eval group on {split}, and headroom left (ceiling - last eval)")  # fmt: skip
    return ceiling


def main(argv: list[str] | None = None) -> dict:
    from trace_mega.commands.demo import _mean_curve, eval_curve, first_reaching, learning

    ap = parser(__doc__, RESULTS / "learning_per_trajectory.json")
    ap.add_argument("--arm", action="append", required=True, help="NAME=GLOB of its seeds' run directories")
    ap.add_argument("--kept", action="append", default=[], help="an arm counted by its kept trajectories")
    ap.add_argument("--threshold", type=float, default=None, help="without a uniform arm: the eval reward to reach")
    ap.add_argument("--split", default="test", help="the evaluated split")
    ap.add_argument("--versus", action="append", default=[], help="A/B: bootstrap A's trajectories over B's")
    ap.add_argument("--draws", type=int, default=2000, help="bootstrap draws over the seeds")
    ap.add_argument("--from-step", type=int, default=0, help="first step of the per-group contrast table")
    ap.add_argument("--ceiling", action="store_true", help="each eval group's exact ceiling and headroom left")
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
    versus = [tuple(v.split("/", 1)) for v in args.versus]
    if unknown := sorted({a for p in versus for a in p} - set(runs)):
        raise SystemExit(f"--versus names arms that are not given: {', '.join(unknown)}; arms: {', '.join(runs)}")
    pairs = [(name, "uniform") for name in runs if name != "uniform" and "uniform" in runs] + versus
    fixed = None if "uniform" in runs else threshold
    intervals = (
        bootstrap_ratios(
            {n: [eval_curve(r, args.split) for r in rs] for n, rs in runs.items()}, pairs, fixed, args.draws
        )
        if threshold is not None and pairs
        else {}
    )
    rows = []
    for name, rs in runs.items():
        t = table[name]
        to = t.get("trajectories_to_threshold")  # absent, as every learning key, for runs never evaluated
        finals = t.get("eval_reward_final_per_seed", [])
        rows.append(
            dict(
                arm=name + (" (kept)" if name in args.kept else ""),
                seeds=len(rs),
                contrasted=statistics.fmean(statistics.fmean(r["alloc/contrasted_prompts"] for r in run) for run in rs),
                to=to,
                ratio=to / ref if to is not None and ref else None,
                interval=_interval(intervals[(name, "uniform")]) if (name, "uniform") in intervals else None,
                per_seed=" / ".join(
                    "never" if x is None else f"{x:.0f}" for x in t.get("trajectories_to_threshold_per_seed", [])
                ),
                auc=t.get("eval_auc"),
                final=statistics.fmean(finals) if finals else None,
                final_per_seed=" / ".join(f"{x:.3f}" for x in finals),
                falls=" / ".join(f"{largest_fall(eval_curve(r, args.split)):.3f}" for r in rs),
                fallback=" / ".join(f"{sum(r.get('alloc/fallback', 0.0) for r in run):.0f}" for run in rs),
            )
        )
    print_table(
        rows,
        [("arm", "arm", "<"), ("seeds", "seeds", "d"), ("contrasted", "contrasted groups / step", ".2f"),
         ("to", "trajectories to threshold", ".0f"), ("ratio", "x uniform's", ".2f"),
         ("interval", "90% interval", "<"), ("per_seed", "per seed", "<"),
         ("auc", "eval AUC", ".3f"), ("final", "final", ".3f"), ("final_per_seed", "per seed", "<"),
         ("falls", "largest fall", "<"), ("fallback", "fallback steps", "<")],
        title=f"threshold {threshold:.4f} (held-out eval)" if threshold is not None else "no held-out evaluation",
    )  # fmt: skip
    versus_rows = []
    for a, b in versus:
        ta, tb = table[a]["trajectories_to_threshold"], table[b]["trajectories_to_threshold"]
        ratio = ta / tb if ta is not None and tb else None
        versus_rows.append(dict(pair=f"{a} / {b}", ratio=ratio, interval=_interval(intervals[(a, b)])))
    if versus_rows:
        print_table(versus_rows, [("pair", "arms", "<"), ("ratio", "trajectories to threshold, ratio", ".2f"),
                                  ("interval", "90% interval", "<")], title="arm against arm")  # fmt: skip
    levels = forgetting_table(runs, args.split)
    composition = composition_table(runs, args.from_step)
    first_run = sorted(glob.glob(next(iter(arms.values()))))[0] if args.ceiling else None
    ceiling = ceiling_table(first_run, levels, args.split) if first_run else None
    curves = {
        name: [[round(x), round(y, 4)] for x, y in table[name]["eval_curve"]]
        for name in runs
        if "eval_curve" in table[name]
    }
    result = {
        "command": command_line(__file__, argv),
        "threshold": threshold,
        "rows": rows,
        "versus": versus_rows,
        "curves": curves,
        "forgetting": levels,
        "contrasted_per_group": composition["contrasted"],
        "contrasted_share_per_group": composition["share"],
        "ceiling": ceiling,
    }
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
