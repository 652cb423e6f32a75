"""`trace-mega demo`: the embedded default run, on CPU — the allocation ablation at equal budget.

Trains the tiny GPT policy of a shipped demo config (default `demo_cpu`: the learnable
`synthetic_tools` environment, minutes; `demo_headroom_cpu`: the `synthetic_levels` task
set with a held-out split, the learning-per-trajectory comparison; `demo_headroom_b16_cpu`:
the same at 16 trajectories a step) once per method and seed, every method from the same
warm start and seed at equal generated trajectories:

* `uniform` — GRPO: random prompts, flat groups;
* `dapo` — DAPO dynamic sampling: zero-variance groups dropped, fresh ones drawn until the
  target or the budget (every generated trajectory counted);
* `treepo` — tree rollouts with branch points chosen at random;
* `trace` — predictor-guided root and prefix allocation (with the fallback guard).

Learning per trajectory (`LEARNING_KEYS`, from the periodic held-out evaluation):
`eval_curve` is [trajectories generated so far, eval reward] at every evaluation;
`threshold` (top level of `report.json`) is uniform's final eval reward, mean over seeds,
fixed before any comparison; `trajectories_to_threshold` the trajectories at the first
evaluation of the seed-mean curve at or above it (null when never; per seed beside it); `eval_auc` the mean eval
reward over the trajectories (trapezoid area / span) up to the fewest trajectories any arm
of the seed generated, so every arm is integrated over the same range; `forgetting_max_drop`
the largest drop of one eval group (a difficulty level) from its best evaluation to the last.

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

METHODS = ("uniform", "dapo", "treepo", "trace")
DEFAULT_PRETRAIN = {
    "demo_cpu": "pretrain_tools",
    "demo_headroom_cpu": "pretrain_levels",
    "demo_headroom_b16_cpu": "pretrain_levels",
}
"""The warm start's transcript policy of each shipped demo config (other configs: `pretrain_tools`)."""
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
    "optimizer_steps_per_step",
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
        "optimizer_steps_per_step": _mean(rows, "loss/optimizer_steps"),  # > 1 with mini-batches sized by contrast
        "wall_s": wall_s,
    }


LEARNING_KEYS = (
    "eval_curve",
    "trajectories_to_threshold",
    "tokens_to_threshold",
    "eval_auc",
    "eval_reward_final",
    "forgetting_max_drop",
    "effective_ratio_mean",
    "trajectories_per_step",
)


def eval_curve(rows: list[dict[str, float]], split: str = "test", tokens: bool = False) -> list[list[float]]:
    """[trajectories (or generated tokens) generated up to and including the step, its eval reward] at
    every step with a held-out evaluation."""
    spent, curve = 0.0, []
    for r in rows:
        spent += r.get("rollout/generated_tokens" if tokens else "alloc/generated_trajectories", 0.0)
        if f"eval/{split}/reward" in r:
            curve.append([spent, r[f"eval/{split}/reward"]])
    return curve


def first_reaching(curve: list[list[float]], threshold: float) -> Optional[float]:
    """x of the first point of `curve` at or above `threshold`; None when none is."""
    return next((x for x, y in curve if y >= threshold), None)


def curve_auc(curve: list[list[float]], x_max: float) -> float:
    """Mean of the piecewise-linear curve over [its first x, x_max] (trapezoid area / span); the curve is
    cut (interpolated) at x_max."""
    pts = [p for p in curve if p[0] <= x_max]
    nxt = next((p for p in curve if p[0] > x_max), None)
    if nxt is not None and pts and x_max > pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-1], nxt
        pts.append([x_max, y0 + (y1 - y0) * (x_max - x0) / (x1 - x0)])
    if len(pts) < 2:
        return pts[0][1] if pts else float("nan")
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def forgetting(rows: list[dict[str, float]], split: str = "test") -> dict[str, float]:
    """Per eval group (`eval/<split>/<group>/mean@n`, a difficulty level): best eval minus the last."""
    return {g: max(v) - v[-1] for g, v in group_evals(rows, split).items()}


def group_evals(rows: list[dict[str, float]], split: str = "test") -> dict[str, list[float]]:
    """Per eval group (`eval/<split>/<group>/mean@n`, not the macro average), its evals in step order."""
    per: dict[str, list[float]] = {}
    for r in rows:
        for key, val in r.items():
            parts = key.split("/")
            if (
                len(parts) == 4
                and parts[:2] == ["eval", split]
                and parts[3].startswith("mean@")
                and parts[2] != "macro"
            ):
                per.setdefault(parts[2], []).append(val)
    return dict(sorted(per.items()))


def warm_start(base: TrainConfig, pretrain_config_path: Optional[str | Path] = None) -> str:
    """The cached warm-start checkpoint of the demo (trained now if not cached): the transcript policy of
    `pretrain_config_path` (default: the shipped `pretrain_tools`) on the demo's own environment and model."""
    from trace_mega.commands.pretrain import pretrain

    pcfg = load_yaml(PretrainConfig, pretrain_config_path or resolve_config("pretrain_tools"))
    pcfg = dataclasses.replace(pcfg, env=base.env, model=dataclasses.replace(base.model, hf_checkpoint=None))
    return str(pretrain(pcfg))


def _train(cfg: TrainConfig, run_dir: Path) -> float:
    """Train one arm (or reuse its finished run: `done.json` with the same config); its wall seconds."""
    from trace_mega.trainer import Trainer

    done = run_dir / "done.json"
    want = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    if done.exists():
        prev = json.loads(done.read_text())
        if prev["config"] == want:
            print(f"{run_dir}: finished before with this config, reused")
            return prev["wall_s"]
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    wall_s = time.perf_counter() - t0
    done.write_text(json.dumps({"config": want, "wall_s": wall_s}))
    return wall_s


def run_demo(
    out_dir: str | Path = "runs/demo",
    config_path: Optional[str | Path] = None,
    overrides: Optional[list[str]] = None,
    seeds: int = 1,
    pretrain_config_path: Optional[str | Path] = None,
    from_scratch: bool = False,
    methods: tuple[str, ...] = METHODS,
) -> dict[str, dict]:
    """Run `methods` on seeds base.seed .. base.seed + seeds - 1 (one run at a time; a run finished before
    with the same config is reused) and write the report; returns {method: {REPORT_KEYS: mean over seeds,
    LEARNING_KEYS}}. Every run starts from the warm start (`warm_start`; the config's `DEFAULT_PRETRAIN`)
    unless `from_scratch` or the config names its own `model.hf_checkpoint`."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown demo methods {unknown or methods}; valid: {', '.join(METHODS)}")
    out = Path(out_dir)
    config_path = config_path or resolve_config("demo_cpu")
    base = load_yaml(TrainConfig, config_path, overrides)
    if not from_scratch and base.model.hf_checkpoint is None:
        pretrain_config_path = pretrain_config_path or resolve_config(
            DEFAULT_PRETRAIN.get(Path(config_path).stem, "pretrain_tools")
        )
        base = dataclasses.replace(
            base, model=dataclasses.replace(base.model, hf_checkpoint=warm_start(base, pretrain_config_path))
        )
    split = base.eval.split
    per_seed: dict[str, list[dict]] = {m: [] for m in methods}
    runs: dict[str, list[list[dict[str, float]]]] = {m: [] for m in methods}
    collapses: list[str] = []
    for k in range(seeds):
        for method in methods:
            run_dir = out / method / f"seed{base.seed + k}"
            cfg = dataclasses.replace(
                base,
                seed=base.seed + k,
                allocation=dataclasses.replace(base.allocation, name=method),
                telemetry=dataclasses.replace(base.telemetry, out_dir=str(run_dir)),
                checkpoint=dataclasses.replace(base.checkpoint, dir=None),
            )
            wall_s = _train(cfg, run_dir)
            rows = read_metrics(run_dir / "metrics.jsonl")
            per_seed[method].append(summarise(rows, wall_s, split=split))
            runs[method].append(rows)
            if collapsed(rows):
                collapses.append(f"{method} seed {cfg.seed}")

    plot_curves(
        {m: r[0] for m, r in runs.items()},
        ["reward/mean", "alloc/effective_ratio", "predictor/skill_smoothed", "alloc/fallback"],
        out / "curves.png",
        title=f"seed {base.seed}, equal budget: {base.allocation.root_rollouts_per_step} root rollouts/step "
        f"x (1 + {base.allocation.continuations_per_rollout}) trajectories",
    )
    table: dict[str, dict] = {
        m: {key: statistics.fmean(s[key] for s in seeds_) for key in REPORT_KEYS} for m, seeds_ in per_seed.items()
    }
    threshold = learning(runs, table, split)
    if threshold is not None:
        plot_eval_curves(runs, threshold, out / "eval_curves.png", split)
    (out / "report.json").write_text(json.dumps({"threshold": threshold, "methods": table}, indent=1))
    _write_report(out, base, table, per_seed, collapses, threshold)
    return table


def _mean_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """Point-wise mean over seeds of curves evaluated at the same steps (x and y both averaged)."""
    return [[statistics.fmean(p) for p in zip(*pts)] for pts in zip(*curves)]


def learning(runs: dict[str, list[list[dict[str, float]]]], table: dict[str, dict], split: str) -> Optional[float]:
    """Add `LEARNING_KEYS` to each method's row of `table` (in place); returns the threshold (uniform's
    final eval reward, mean over seeds; else the first method's), None when no run evaluated."""
    curves = {m: [eval_curve(r, split) for r in rs] for m, rs in runs.items()}
    if not all(c for cs in curves.values() for c in cs):
        return None
    ref = "uniform" if "uniform" in curves else next(iter(curves))
    threshold = statistics.fmean(c[-1][1] for c in curves[ref])
    seeds = len(next(iter(curves.values())))
    # Every arm of a seed integrated over the same trajectories: up to the fewest any arm generated.
    spans = [min(cs[k][-1][0] for cs in curves.values()) for k in range(seeds)]
    for m, cs in curves.items():
        mean_curve = _mean_curve(cs)
        tok_curves = [eval_curve(r, split, tokens=True) for r in runs[m]]
        drops = [forgetting(r, split) for r in runs[m]]
        table[m] |= {
            "eval_curve": mean_curve,
            # On the seed-mean curve (so uniform reaches its own mean final at its last evaluation at
            # the latest); the per-seed values beside it (a seed may end below the mean: null).
            "trajectories_to_threshold": first_reaching(mean_curve, threshold),
            "trajectories_to_threshold_per_seed": [first_reaching(c, threshold) for c in cs],
            "tokens_to_threshold": first_reaching(_mean_curve(tok_curves), threshold),
            "eval_auc": statistics.fmean(curve_auc(c, spans[k]) for k, c in enumerate(cs)),
            "eval_auc_per_seed": [curve_auc(c, spans[k]) for k, c in enumerate(cs)],
            "eval_reward_final_per_seed": [c[-1][1] for c in cs],
            "forgetting_max_drop": statistics.fmean(max(d.values(), default=0.0) for d in drops),
            "forgetting_per_group": {g: statistics.fmean(d.get(g, 0.0) for d in drops) for g in drops[0]},
        }
    return threshold


def plot_eval_curves(
    runs: dict[str, list[list[dict[str, float]]]], threshold: float, path: Path, split: str = "test"
) -> Path:
    """Held-out eval reward against trajectories generated, every seed of every method (one colour per
    method), with the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (m, rs) in enumerate(runs.items()):
        for k, rows in enumerate(rs):
            pts = eval_curve(rows, split)
            ax.plot(
                *zip(*pts),
                marker="o",
                ms=3,
                color=f"C{i % 10}",
                alpha=1.0 if k == 0 else 0.45,
                label=m if k == 0 else None,
            )
    ax.axhline(threshold, color="k", ls="--", lw=1, label=f"threshold {threshold:.3f}")
    ax.set(xlabel="trajectories generated", ylabel=f"eval/{split}/reward", title="held-out reward per trajectory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _row(name: str, row: dict) -> str:
    return f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in REPORT_KEYS) + " |"


def _fmt(x) -> str:
    return "never" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.0f}"


def _learning_lines(table: dict[str, dict], threshold: float, split: str) -> list[str]:
    cols = LEARNING_KEYS[1:]  # every learning key but the curve itself
    lines = [
        f"Learning per trajectory, held-out split `{split}` (threshold {threshold:.3f}: uniform's final eval "
        "reward, mean over seeds; trajectories to it on the seed-mean curve, `never` when it stays below):",
        "",
        "| method | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
        *(f"| {m} | " + " | ".join(_fmt(row[c]) for c in cols) + " |" for m, row in table.items()),
        "",
    ]
    u = table.get("uniform", {}).get("trajectories_to_threshold")
    if u:
        ratios = {m: row["trajectories_to_threshold"] for m, row in table.items() if m != "uniform"}
        text = (f"{m} / uniform trajectories to threshold = {_fmt(t and t / u)}" for m, t in ratios.items())
        lines += [", ".join(text), ""]
    return lines + ["![eval curves](eval_curves.png)", ""]


def _write_report(
    out: Path,
    cfg: TrainConfig,
    table: dict[str, dict],
    per_seed: dict[str, list[dict]],
    collapses: list[str],
    threshold: Optional[float] = None,
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
    ]
    if threshold is not None:
        lines += _learning_lines(table, threshold, cfg.eval.split)
    summary_at = len(lines)
    lines += [*header, *(_row(m, row) for m, row in table.items()), ""]
    if all(m in table for m in ("trace", "treepo", "uniform")):
        tr, tp, un = (table[m]["effective_ratio_mean"] for m in ("trace", "treepo", "uniform"))
        if tp > 0 and un > 0:
            lines += [f"Effective ratio: trace / treepo = {tr / tp:.2f}x, trace / uniform = {tr / un:.2f}x.", ""]
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
    print("\n".join(lines[4:summary_at] + lines[summary_at : summary_at + 2 + len(table) + 3]))
    print(f"report: {out / 'report.md'}")
