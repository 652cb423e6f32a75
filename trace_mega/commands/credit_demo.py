"""`trace-mega demo credit`: does TRACE-C's turn credit make learning faster? On CPU, in minutes.

From the cached warm start (`trace-mega pretrain`, configs/pretrain_search.yaml),
trains on `synthetic_search` at equal trajectory budget, for each of 3 seeds:

* ``grpo``        — flat groups (`uniform` allocation), `grpo` outcome advantage;
* ``grpo+credit`` — the same plus TRACE-C turn credit (`credit.enabled`);
* ``tree``        — tree rollouts (`treepo`: uniform branching from prefixes), `tree` advantage;
* ``tree+credit`` — the same plus TRACE-C.

The warm start is the policy's initialisation and, for the credit methods, the
frozen reference (`model.hf_checkpoint`). Writes `report.md`, `report.json`
(per method: `steps_to_threshold`, `reward_last10`, `turns_per_episode_last10`,
`credit_auc_mean`, plus per-seed values), `curves.png` (seed-mean reward, turns
per episode and credit/auc per step) and every run's `metrics.jsonl`.

Steps to threshold: the first step s (1-based) at which the mean reward of
steps s−w+1 … s (w = `window`) reaches `threshold`; a run that never does counts
as `steps + 1` (censored) and the report says how many seeds reached it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from trace_mega.commands.pretrain import PretrainConfig
from trace_mega.config import TrainConfig, load_yaml
from trace_mega.resources import configs_dir
from trace_mega.telemetry import plot_curves, read_metrics

CONFIG_DIR = configs_dir()  # the shipped configs (a wheel install has them as package data)
DEFAULT_CONFIG = CONFIG_DIR / "credit_demo.yaml"
DEFAULT_PRETRAIN = CONFIG_DIR / "pretrain_search.yaml"
METHODS: dict[str, dict[str, Any]] = {
    "grpo": {"allocation": "uniform", "advantage": "grpo", "credit": False},
    "grpo+credit": {"allocation": "uniform", "advantage": "grpo", "credit": True},
    "tree": {"allocation": "treepo", "advantage": "tree", "credit": False},
    "tree+credit": {"allocation": "treepo", "advantage": "tree", "credit": True},
}


def method_config(base: TrainConfig, method: str, seed: int, checkpoint: str, out_dir: Path) -> TrainConfig:
    """`base` with `method`'s allocator / estimator / credit switch, `seed`, the warm start and an out dir."""
    m = METHODS[method]
    return dataclasses.replace(
        base,
        seed=seed,
        allocation=dataclasses.replace(base.allocation, name=m["allocation"]),
        advantage=dataclasses.replace(base.advantage, name=m["advantage"]),
        credit=dataclasses.replace(base.credit, enabled=m["credit"]),
        model=dataclasses.replace(base.model, hf_checkpoint=checkpoint),
        telemetry=dataclasses.replace(base.telemetry, out_dir=str(out_dir)),
        checkpoint=dataclasses.replace(base.checkpoint, dir=None),
    )


def steps_to_threshold(rewards: Sequence[float], threshold: float, window: int) -> Optional[int]:
    """First 1-based step whose trailing `window`-step mean reward is >= `threshold` (None: never)."""
    for s in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[s - window : s]) >= threshold:
            return s
    return None


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else float("nan")


def _last(rows: list[dict], key: str, n: int) -> float:
    return _mean([r[key] for r in rows if key in r][-n:])


EXTRA_THRESHOLDS = (0.5, 0.7, 0.8, 0.9)
"""Also reported (report.json `steps_to_threshold_at`), so the choice of threshold can be judged."""


def _censored_mean(reached: Sequence[Optional[int]], steps: int) -> float:
    return _mean([s if s is not None else steps + 1 for s in reached])


def summarize(runs: dict[str, list[list[dict]]], steps: int, threshold: float, window: int) -> dict[str, dict]:
    """report.json's table from each method's per-seed metric rows."""
    table = {}
    for method, seeds in runs.items():
        curves = [[r["reward/mean"] for r in rows] for rows in seeds]
        reached = [steps_to_threshold(c, threshold, window) for c in curves]
        table[method] = {
            "steps_to_threshold": _censored_mean(reached, steps),
            "steps_to_threshold_at": {
                str(t): _censored_mean([steps_to_threshold(c, t, window) for c in curves], steps)
                for t in EXTRA_THRESHOLDS
            },
            "steps_to_threshold_per_seed": reached,
            "seeds_reaching_threshold": sum(s is not None for s in reached),
            "reward_last10": _mean([_last(rows, "reward/mean", 10) for rows in seeds]),
            "reward_first10": _mean([_mean([r["reward/mean"] for r in rows[:10]]) for rows in seeds]),
            "turns_per_episode_last10": _mean([_last(rows, "rollout/turns_per_episode", 10) for rows in seeds]),
            "turns_per_episode_first10": _mean(
                [_mean([r["rollout/turns_per_episode"] for r in rows[:10]]) for rows in seeds]
            ),
            "credit_auc_mean": _mean([_mean([r.get("credit/auc", math.nan) for r in rows]) for rows in seeds]),
            "credit_auc_R_mean": _mean([_mean([r.get("credit/auc_R", math.nan) for r in rows]) for rows in seeds]),
            "credit_auc_last10": _mean([_last(rows, "credit/auc", 10) for rows in seeds]),
            "credit_auc_R_last10": _mean([_last(rows, "credit/auc_R", 10) for rows in seeds]),
        }
    return table


def _seed_mean_rows(seeds: list[list[dict]]) -> list[dict]:
    """Per step, the mean over seeds of every metric (for the curves)."""
    n = min(len(rows) for rows in seeds)
    keys = ["reward/mean", "rollout/turns_per_episode", "credit/auc"]
    return [
        {
            "step": i,
            **{
                k: _mean([rows[i].get(k, math.nan) for rows in seeds])
                for k in keys
                if any(k in rows[i] for rows in seeds)
            },
        }
        for i in range(n)
    ]


def run_credit_demo(
    out_dir: str | Path = "runs/credit_demo",
    config_path: Optional[str] = None,
    pretrain_config_path: Optional[str] = None,
    overrides: Optional[list[str]] = None,
    seeds: Sequence[int] = (0, 1, 2),
    methods: Sequence[str] = tuple(METHODS),
    threshold: float = 0.8,
    window: int = 5,
) -> dict[str, dict]:
    """Warm start (cached), then every method x seed; writes the report and returns report.json's table."""
    from trace_mega.commands.pretrain import pretrain
    from trace_mega.trainer import Trainer

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown credit-demo method(s) {unknown}; valid: {', '.join(METHODS)}")
    out = Path(out_dir)
    t_start = time.perf_counter()
    pcfg = load_yaml(PretrainConfig, pretrain_config_path or DEFAULT_PRETRAIN)
    checkpoint = str(pretrain(pcfg))
    pretrain_s = time.perf_counter() - t_start
    base = load_yaml(TrainConfig, config_path or DEFAULT_CONFIG, overrides)
    runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
    seconds: dict[str, float] = {m: 0.0 for m in methods}
    for seed in seeds:
        for method in methods:
            run_dir = out / method / f"seed{seed}"
            t0 = time.perf_counter()
            trainer = Trainer(method_config(base, method, seed, checkpoint, run_dir))
            try:
                trainer.train()
            finally:
                trainer.close()
            seconds[method] += time.perf_counter() - t0
            runs[method].append(read_metrics(run_dir / "metrics.jsonl"))
    table = summarize(runs, base.steps, threshold, window)
    for m in methods:
        table[m]["wall_s"] = seconds[m]
    meta = {
        "threshold": threshold,
        "window": window,
        "steps": base.steps,
        "seeds": list(seeds),
        "trajectories_per_step": _mean([r["alloc/trajectories"] for rows in runs[methods[0]] for r in rows]),
        "checkpoint": checkpoint,
        "pretrain_s": pretrain_s,
        "total_s": time.perf_counter() - t_start,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"methods": table, "meta": meta}, indent=1))
    plot_curves(
        {m: _seed_mean_rows(runs[m]) for m in methods},
        ["reward/mean", "rollout/turns_per_episode", "credit/auc"],
        out / "curves.png",
        title=f"synthetic_search from the warm start, mean of {len(seeds)} seeds",
    )
    _write_report(out, base, table, meta)
    return table


def _write_report(out: Path, cfg: TrainConfig, table: dict[str, dict], meta: dict) -> None:
    cols = [
        "steps_to_threshold",
        "seeds_reaching_threshold",
        "reward_first10",
        "reward_last10",
        "turns_per_episode_first10",
        "turns_per_episode_last10",
        "credit_auc_mean",
        "credit_auc_R_mean",
        "credit_auc_R_last10",
        "wall_s",
    ]
    lines = [
        "# trace-mega credit demo",
        "",
        f"`synthetic_search`, {cfg.steps} steps x {len(meta['seeds'])} seeds per method, "
        f"{meta['trajectories_per_step']:.0f} trajectories per step for every method, from the warm start "
        f"`{meta['checkpoint']}` (pretrain {meta['pretrain_s']:.0f} s, total {meta['total_s']:.0f} s). "
        f"Threshold: trailing {meta['window']}-step mean reward >= {meta['threshold']} "
        f"(a run that never reaches it counts {cfg.steps + 1}).",
        "",
        "| method | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for m, row in table.items():
        lines.append(
            f"| {m} | " + " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |"
        )
    lines += ["", "![curves](curves.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines[4 : 4 + 2 + len(table)]))
    print(f"report: {out / 'report.md'}")
