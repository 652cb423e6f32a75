"""How many contrasted groups a step could a root allocator get, knowing what? A bound on what a
better success predictor would buy on `synthetic_levels`, from the held-out evaluations of finished runs.

Each evaluation snapshot (`<run>/eval/step_*.json`: 8 samples of every test prompt under the policy of
that step) stands for one step's prompt pool. A selection rule sees the first half of every prompt's
samples (4 outcomes, as one earlier group), ranks `--pool` prompts drawn at random by the chance that a
new group of 4 is contrasted, 1 - p^4 - (1-p)^4, and takes `--groups` of them two ways: the top of the
ranking, and as `allocation.root_selection: sampled` does (each candidate, in random order, accepted with
that chance; the first accepted are served, then the rest in order). The second half of the taken prompts'
samples (4 fresh outcomes, one group) says whether each taken group is contrasted. The rules differ in
what p is:

* `uniform`: no ranking (the expected count of a random pick).
* `level`: the mean success of the prompt's ice level (what the prompt states) over the first halves.
* `level+distance`: the mean of its (level, |goal - start|) cell; these two fix a prompt's difficulty
  for a walker that moves the right way, so this is the table a predictor that reads both would learn.
* `own group`: the prompt's own first 4 outcomes (a predictor that remembers each prompt's last group).
* `... (contrast)`: the same cells ranked by their mean share of contrasted first halves instead, E[1 -
  p^4 - (1-p)^4] rather than 1 - p̄^4 - (1-p̄)^4: a cell whose mean is 0.5 may hold only solved and
  unsolved prompts.

Beside them, `--measured` run directories give what their allocator really kept per step
(`alloc/contrasted_prompts` in `metrics.jsonl`). Task ids must be synthetic_levels' `levels-S-G-L`.

    python benchmarks/bench_prompt_selection.py --runs 'runs/demo_levels_b16/uniform/seed*' \
        --measured 'runs/demo_levels_b16/uniform/seed*,runs/demo_levels_b16/trace/seed*,runs/ceiling_b16/dapo/seed*'
    trace-mega bench prompt_selection [same options]
"""

from __future__ import annotations

import glob
import json
import random
import statistics
from pathlib import Path

from harness import RESULTS, command_line, parser, print_table, write_json

GROUP = 4  # rollouts per group, and the outcomes each half of a prompt's 8 samples holds


def features(task_id: str) -> tuple[int, int]:
    """(ice level, cells from start to goal) of a `levels-S-G-L` task id."""
    parts = task_id.split("-")
    if len(parts) != 4 or parts[0] != "levels":
        raise ValueError(f"task id {task_id!r} is not synthetic_levels' 'levels-S-G-L'")
    start, goal, level = (int(p) for p in parts[1:])
    return level, abs(goal - start)


def contrasted(rewards: list[float]) -> float:
    """1.0 when a group's outcomes are not all equal."""
    return float(len(set(rewards)) > 1)


def contrast_chance(p: float) -> float:
    """Chance that a group of GROUP Bernoulli(p) outcomes is contrasted."""
    return 1.0 - p**GROUP - (1.0 - p) ** GROUP


def cell_means(keys: list, values: list[float]) -> list[float]:
    """Each item's mean of `values` over the items sharing its key."""
    sums: dict = {}
    for k, v in zip(keys, values):
        s = sums.setdefault(k, [0.0, 0])
        s[0] += v
        s[1] += 1
    return [sums[k][0] / sums[k][1] for k in keys]


def scores(tasks: list[dict]) -> dict[str, list[float]]:
    """Per rule, each task's ranking score (higher is picked first) from the first halves only."""
    first = [t["rewards"][:GROUP] for t in tasks]
    success = [sum(r) / GROUP for r in first]
    contrast = [contrasted(r) for r in first]
    feats = [features(t["task_id"]) for t in tasks]
    cells = {"level": [f[0] for f in feats], "level+distance": feats}
    out = {"uniform": [0.0] * len(tasks), "own group": [contrast_chance(p) for p in success]}
    for name, keys in cells.items():
        out[name] = [contrast_chance(p) for p in cell_means(keys, success)]
        out[f"{name} (contrast)"] = cell_means(keys, contrast)
    return out


def selected_contrast(
    tasks: list[dict], score: list[float], pool: int, groups: int, draws: int, rng, sampled: bool = False
) -> float:
    """Mean contrasted groups among `groups` of `pool` random tasks, judged on the second halves of their
    samples: the top by `score` (ties at random), or with `sampled` those accepted with chance `score`
    in random order, the unaccepted after them (the trace allocator's sampled roots)."""
    fresh = [contrasted(t["rewards"][GROUP : 2 * GROUP]) for t in tasks]
    total = 0.0
    for _ in range(draws):
        cand = rng.sample(range(len(tasks)), min(pool, len(tasks)))
        if sampled:
            ranked = sorted(cand, key=lambda i: rng.random() >= score[i])  # stable: accepted first, order kept
        else:
            ranked = sorted(cand, key=lambda i: (-score[i], rng.random()))
        total += sum(fresh[i] for i in ranked[:groups])
    return total / draws


def measured(run_dirs: list[str]) -> list[dict]:
    """Mean `alloc/contrasted_prompts` per step of finished runs, grouped by their parent directory."""
    by_arm: dict[str, list[float]] = {}
    for d in run_dirs:
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        arm = str(Path(d).parent)
        by_arm.setdefault(arm, []).append(statistics.fmean(r["alloc/contrasted_prompts"] for r in rows))
    return [dict(arm=a, runs=len(v), contrasted=statistics.fmean(v)) for a, v in by_arm.items()]


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "prompt_selection.json")
    ap.add_argument("--runs", required=True, help="run directories holding eval/step_*.json (globs, comma-separated)")
    ap.add_argument(
        "--measured", default="", help="run directories whose kept contrast to show (globs, comma-separated)"
    )
    ap.add_argument("--pool", type=int, default=128, help="candidate prompts scored per step")
    ap.add_argument("--groups", type=int, default=4, help="groups of 4 taken per step")
    ap.add_argument("--draws", type=int, default=1000, help="random pools per snapshot")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    expand = lambda spec: sorted(p for g in spec.split(",") if g for p in glob.glob(g))  # noqa: E731
    snapshots = [s for d in expand(args.runs) for s in sorted(Path(d).glob("eval/step_*.json"))]
    if not snapshots:
        raise SystemExit(f"no eval/step_*.json under {args.runs!r}")
    rng = random.Random(args.seed)
    per_rule: dict[str, tuple[list[float], list[float]]] = {}
    for snap in snapshots:
        tasks = [t for t in json.loads(snap.read_text())["tasks"] if len(t["rewards"]) >= 2 * GROUP]
        for rule, score in scores(tasks).items():
            top, sampled = per_rule.setdefault(rule, ([], []))
            top.append(selected_contrast(tasks, score, args.pool, args.groups, args.draws, rng))
            sampled.append(selected_contrast(tasks, score, args.pool, args.groups, args.draws, rng, sampled=True))
    rows = [
        dict(rule=r, contrasted=statistics.fmean(t), low=min(t), high=max(t), sampled=statistics.fmean(s))
        for r, (t, s) in per_rule.items()
    ]
    print_table(
        rows,
        [("rule", "selection rule", "<"), ("contrasted", "contrasted groups / step, top", ".2f"), ("low", "min", ".2f"),
         ("high", "max", ".2f"), ("sampled", "sampled roots", ".2f")],
        title=f"{args.groups} groups of {GROUP} from {args.pool} candidates, over {len(snapshots)} evaluation snapshots",
    )  # fmt: skip
    kept = measured(expand(args.measured))
    if kept:
        print_table(kept, [("arm", "run", "<"), ("runs", "seeds", "d"), ("contrasted", "contrasted groups / step", ".2f")],
                    title="Measured in training (alloc/contrasted_prompts)")  # fmt: skip
    result = {"command": command_line(__file__, argv), "snapshots": len(snapshots), "rules": rows, "measured": kept}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
