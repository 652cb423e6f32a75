"""`trace-mega demo`: the embedded default run, on CPU, in minutes — the paper's three-arm ablation.

Trains the tiny GPT policy of the shipped `demo_cpu` config on the learnable
`synthetic_tools` environment once per method and seed, every method from the same
initialisation and seed at equal rollout budget:

* `uniform` — GRPO: random prompts, flat groups;
* `treepo` — tree rollouts with branch points chosen at random;
* `trace` — predictor-guided root and prefix allocation (with the fallback guard).

The report (`report.md`, `report.json`, `curves.png` of the first seed, the
predictor's reliability curve, each run's `metrics.jsonl` under
`<out>/<method>/seed<k>/`) gives per method the mean over seeds of the keys in
`REPORT_KEYS`. `predictor_skill_mean` is the pooled held-out Brier skill of the
step's predictor (1 - Σ brier / Σ brier_constant over the steps, each measured on
trees before the predictor fits them), `predictor_root_skill_mean` the same over the
prompts (roots) alone, what the root plan reads; every arm fits the predictor, only
trace reads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Optional

from trace_mega.commands.pretrain import PretrainConfig
from trace_mega.config import TrainConfig, load_yaml
from trace_mega.resources import resolve_config
from trace_mega.telemetry import plot_curves, read_metrics

METHODS = ("uniform", "treepo", "trace")
REPORT_KEYS = (
    "effective_ratio_mean",
    "contrasted_prompts_mean",
    "active_prompts_mean",
    "contrasted_groups_mean",
    "predictor_fallback_frac",
    "predictor_skill_mean",
    "predictor_root_skill_mean",
    "reward_first10",
    "reward_last10",
    "eval_reward_final",
    "trajectories_per_step",
    "generated_tokens_per_step",
    "wall_s",
)


def _mean(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else float("nan")


def pooled_skill(rows: list[dict[str, float]], kind: str = "") -> float:
    """1 - Σ brier·n / Σ brier_constant·n over the steps with a held-out constant (skill not NaN);
    `kind` "root_": the roots' own (`predictor/root_brier`, ...)."""
    key = f"predictor/{kind}"
    scored = [r for r in rows if r.get(key + "skill", math.nan) == r.get(key + "skill", math.nan)]
    b = sum(r[key + "brier"] * r[key + "samples"] for r in scored)
    c = sum(r[key + "brier_constant"] * r[key + "samples"] for r in scored)
    return 1.0 - b / c if c > 0 else float("nan")


def collapsed(rows: list[dict[str, float]], learned_reward: float = 0.1, entropy_floor: float = 0.1) -> bool:
    """Whether a run collapsed: after a step with reward >= `learned_reward`, a step with reward 0
    and token entropy below `entropy_floor` (a near-deterministic policy that no longer succeeds;
    its steps have no contrast, so no gradient brings it back)."""
    learned = False
    for r in rows:
        learned = learned or r.get("reward/mean", 0.0) >= learned_reward
        if learned and r.get("reward/mean", 1.0) == 0.0 and r.get("loss/token_entropy", 1.0) < entropy_floor:
            return True
    return False


def _last(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else float("nan")


def summarise(rows: list[dict[str, float]], wall_s: float, split: str = "test") -> dict[str, float]:
    """The `REPORT_KEYS` of one run's metrics rows."""
    return {
        "effective_ratio_mean": _mean(rows, "alloc/effective_ratio"),
        "contrasted_prompts_mean": _mean(rows, "alloc/contrasted_prompts"),
        "active_prompts_mean": _mean(rows, "alloc/active_prompts"),
        "contrasted_groups_mean": _mean(rows, "alloc/contrasted_groups"),
        "predictor_fallback_frac": _mean(rows, "alloc/fallback"),
        "predictor_skill_mean": pooled_skill(rows),
        "predictor_root_skill_mean": pooled_skill(rows, "root_"),
        "reward_first10": _mean(rows[:10], "reward/mean"),
        "reward_last10": _mean(rows[-10:], "reward/mean"),
        # The policy on every task (the training reward is over the prompts each method chose).
        "eval_reward_final": _last(rows, f"eval/{split}/reward"),
        "trajectories_per_step": _mean(rows, "alloc/generated_trajectories"),  # generated (dapo drops some)
        "generated_tokens_per_step": _mean(rows, "rollout/generated_tokens"),
        "wall_s": wall_s,
    }


def warm_start(base: TrainConfig, pretrain_config_path: Optional[str | Path] = None) -> str:
    """The cached warm-start checkpoint of the demo (trained now if not cached): the transcript policy of
    `pretrain_config_path` (default: the shipped `pretrain_tools`) on the demo's own environment and model."""
    from trace_mega.commands.pretrain import pretrain

    pcfg = load_yaml(PretrainConfig, pretrain_config_path or resolve_config("pretrain_tools"))
    pcfg = dataclasses.replace(pcfg, env=base.env, model=dataclasses.replace(base.model, hf_checkpoint=None))
    return str(pretrain(pcfg))


def run_demo(
    out_dir: str | Path = "runs/demo",
    config_path: Optional[str | Path] = None,
    overrides: Optional[list[str]] = None,
    seeds: int = 1,
    pretrain_config_path: Optional[str | Path] = None,
    from_scratch: bool = False,
) -> dict[str, dict[str, float]]:
    """Run every method of `METHODS` on seeds base.seed .. base.seed + seeds - 1 (one run at a time)
    and write the report; returns {method: {REPORT_KEYS: mean over seeds}}. Every run starts from the warm
    start (`warm_start`) unless `from_scratch` or the config names its own `model.hf_checkpoint`."""
    from trace_mega.trainer import Trainer

    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    out = Path(out_dir)
    base = load_yaml(TrainConfig, config_path or resolve_config("demo_cpu"), overrides)
    if not from_scratch and base.model.hf_checkpoint is None:
        base = dataclasses.replace(
            base, model=dataclasses.replace(base.model, hf_checkpoint=warm_start(base, pretrain_config_path))
        )
    per_seed: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    first_runs: dict[str, list[dict[str, float]]] = {}
    collapses: list[str] = []
    for k in range(seeds):
        for method in METHODS:
            run_dir = out / method / f"seed{base.seed + k}"
            cfg = dataclasses.replace(
                base,
                seed=base.seed + k,
                allocation=dataclasses.replace(base.allocation, name=method),
                telemetry=dataclasses.replace(base.telemetry, out_dir=str(run_dir)),
                checkpoint=dataclasses.replace(base.checkpoint, dir=None),
            )
            t0 = time.perf_counter()
            trainer = Trainer(cfg)
            try:
                trainer.train()
            finally:
                trainer.close()
            rows = read_metrics(run_dir / "metrics.jsonl")
            per_seed[method].append(summarise(rows, time.perf_counter() - t0, split=cfg.eval.split))
            if collapsed(rows):
                collapses.append(f"{method} seed {cfg.seed}")
            if k == 0:
                first_runs[method] = rows

    plot_curves(
        first_runs,
        ["reward/mean", "alloc/effective_ratio", "predictor/skill_smoothed", "alloc/fallback"],
        out / "curves.png",
        title=f"seed {base.seed}, equal budget: {base.allocation.root_rollouts_per_step} root rollouts/step "
        f"x (1 + {base.allocation.continuations_per_rollout}) trajectories",
    )
    table = {m: {key: statistics.fmean(s[key] for s in runs) for key in REPORT_KEYS} for m, runs in per_seed.items()}
    (out / "report.json").write_text(json.dumps(table, indent=1))
    _write_report(out, base, table, per_seed, collapses)
    return table


def _row(name: str, row: dict[str, float]) -> str:
    return f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in REPORT_KEYS) + " |"


def _write_report(
    out: Path,
    cfg: TrainConfig,
    table: dict[str, dict[str, float]],
    per_seed: dict[str, list[dict[str, float]]],
    collapses: list[str],
) -> None:
    seeds = len(next(iter(per_seed.values())))
    header = ["| method | " + " | ".join(REPORT_KEYS) + " |", "|---|" + "---|" * len(REPORT_KEYS)]
    lines = [
        "# trace-mega demo report",
        "",
        f"Environment `{cfg.env.name}`, {cfg.steps} steps, policy: {cfg.model.num_layers} layers x "
        f"{cfg.model.hidden_size} hidden, seeds {cfg.seed}..{cfg.seed + seeds - 1} (means over seeds). Every "
        "method spends the same number of trajectories per step (root rollouts + continuations) from the same "
        "initialisation. `predictor_skill_mean`: pooled held-out Brier skill of the predictor against the "
        "previous step's mean target (> 0 beats the constant); only trace reads it.",
        "",
        *header,
        *(_row(m, row) for m, row in table.items()),
    ]
    tr, tp, un = (table[m]["effective_ratio_mean"] for m in ("trace", "treepo", "uniform"))
    lines += [
        "",
        f"Effective ratio: trace / treepo = {tr / tp:.2f}x, trace / uniform = {tr / un:.2f}x."
        if tp > 0 and un > 0
        else "",
        "",
    ]
    lines += [
        f"Collapsed runs (reward 0 at token entropy < 0.1 after reaching reward 0.1): "
        f"{', '.join(collapses) if collapses else 'none'}.",
        "",
    ]
    if seeds > 1:
        lines += ["Per seed:", "", *header]
        lines += [_row(f"{m} seed {cfg.seed + k}", s) for m, runs in per_seed.items() for k, s in enumerate(runs)]
        lines += [""]
    lines += ["![curves](curves.png)", ""]
    rel = out / "trace" / f"seed{cfg.seed}" / "reliability.png"
    if rel.exists():
        lines += [
            "Predictor reliability (trace run, last step):",
            "",
            f"![reliability](trace/seed{cfg.seed}/reliability.png)",
            "",
        ]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines[4 : 4 + 2 + len(table) + 4]))
    print(f"report: {out / 'report.md'}")
