"""`trace-mega demo`: the embedded default run, on CPU, in minutes.

Trains the tiny GPT policy of the shipped `demo_cpu` config on the learnable
`synthetic_tools` environment twice from the same initialisation and seed —
`uniform` (GRPO: random prompts, flat groups) and `trace` (predictor-guided
root and prefix allocation) at equal rollout budget — and writes a report:
`report.md`, `curves.png` (reward and effective ratio per step), the
predictor's reliability curve, and each run's `metrics.jsonl`.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Optional

from trace_mega.config import TrainConfig, load_yaml
from trace_mega.resources import resolve_config
from trace_mega.telemetry import plot_curves, read_metrics

METHODS = ("uniform", "trace")


def _summary(rows: list[dict[str, float]], key: str, last: Optional[int] = None) -> float:
    vals = [r[key] for r in rows if key in r]
    if last:
        vals = vals[-last:]
    return statistics.fmean(vals) if vals else float("nan")


def run_demo(out_dir: str | Path = "runs/demo", config_path: Optional[str | Path] = None,
             overrides: Optional[list[str]] = None) -> dict[str, dict[str, float]]:
    """Run every method of `METHODS` and write the report; returns the summary table."""
    from trace_mega.trainer import Trainer

    out = Path(out_dir)
    base = load_yaml(TrainConfig, config_path or resolve_config("demo_cpu"), overrides)
    runs: dict[str, list[dict[str, float]]] = {}
    seconds: dict[str, float] = {}
    for method in METHODS:
        cfg = dataclasses.replace(
            base,
            allocation=dataclasses.replace(base.allocation, name=method),
            telemetry=dataclasses.replace(base.telemetry, out_dir=str(out / method)),
            checkpoint=dataclasses.replace(base.checkpoint, dir=None),
        )
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
        seconds[method] = time.perf_counter() - t0
        runs[method] = read_metrics(out / method / "metrics.jsonl")

    plot_curves(runs, ["reward/mean", "alloc/effective_ratio", "alloc/contrasted_groups"], out / "curves.png",
                title=f"equal budget: {base.allocation.root_rollouts_per_step} root rollouts/step "
                      f"x (1 + {base.allocation.continuations_per_rollout}) trajectories")
    table = {
        m: {
            "effective_ratio_mean": _summary(rows, "alloc/effective_ratio"),
            "contrasted_groups_mean": _summary(rows, "alloc/contrasted_groups"),
            "predictor_fallback_frac": _summary(rows, "alloc/fallback"),
            "reward_first3": statistics.fmean([r["reward/mean"] for r in rows[:3]]) if rows else float("nan"),
            "reward_last3": _summary(rows, "reward/mean", last=3),
            "trajectories_per_step": _summary(rows, "alloc/trajectories"),
            "generated_tokens_per_step": _summary(rows, "rollout/generated_tokens"),
            "wall_s": seconds[m],
        }
        for m, rows in runs.items()
    }
    _write_report(out, base, table)
    return table


def _write_report(out: Path, cfg: TrainConfig, table: dict[str, dict[str, float]]) -> None:
    cols = list(next(iter(table.values())).keys())
    lines = [
        "# trace-mega demo report",
        "",
        f"Environment `{cfg.env.name}`, {cfg.steps} steps, policy: {cfg.model.num_layers} layers x "
        f"{cfg.model.hidden_size} hidden, seed {cfg.seed}. Every method spends the same number of "
        "trajectories per step (root rollouts + continuations).",
        "",
        "| method | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for m, row in table.items():
        lines.append(f"| {m} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    lines += ["", "![curves](curves.png)", ""]
    rel = out / "trace" / "reliability.png"
    if rel.exists():
        lines += ["Predictor reliability (trace run, last step):", "", "![reliability](trace/reliability.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines[4:4 + 2 + len(table)]))
    print(f"report: {out / 'report.md'}")
