"""Success-predictor variants in the trainer: held-out Brier skill against the constant, and
the effective ratio the allocation gets from them.

Every variant trains the CPU demo config (`synthetic_tools`, tiny policy) with
`allocation.name=trace` and the fallback guard OFF, so every step's plan reads the
predictor, from the demo's warm start (`--from-scratch`: a random init), for
`--steps` steps on each of `--seeds` seeds (run one after the other). Per step the
trainer measures the predictor on the step's trees BEFORE fitting on them (trees it has
not seen: the "next step" of the previous fit) against the equally held-out constant,
the previous fit's mean target.
Columns:

* `skill` — pooled Brier skill 1 - Σ brier / Σ brier_constant over steps 1.. (each
  step weighted by its number of samples); > 0: better than the constant;
* `steps>0` — share of steps whose own skill is > 0;
* `eff` — mean effective ratio (prompts with a success and a failure / active prompts);
* `reward` — mean reward of the trees; `pred%` — predictor time / step time.

`treepo` (random branch points, no predictor) is the reference the predictor has to
beat; `constant` is trace with an anchored head that never trains (its skill is 0 by
construction), i.e. what trace's solvers do with no information beyond the mean.

`--failures` instead runs treepo and trace with the guard ON, its predictions replaced by
noise, inverted (1 - v) or a constant 0.5 (the predictor's open question: how much does a
broken predictor cost once the guard is on?); `fallback` is the share of steps on treepo.

    python benchmarks/bench_predictor.py [--steps 30] [--seeds 3] [--variants a,b] [--failures] [--from-scratch] [--json PATH]
    trace-mega bench predictor [same options]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
from pathlib import Path

from harness import RESULTS, ROOT, command_line, parser, print_table, write_json

# The shipped demo config before this benchmark: zero-initialised shared head, newest step only, no decay.
OLD = [
    "predictor.anchor_at_mean=false",
    "predictor.replay_steps=1",
    "predictor.weight_decay=0.0",
    "predictor.lr=3e-2",
    "predictor.updates_per_step=8",
    "predictor.root_head=false",
    "predictor.root_token_bag=false",
]
ANCHOR = ["predictor.anchor_at_mean=true"]
REPLAY = ["predictor.replay_steps=4", "predictor.replay_decay=0.7"]
VARIANTS: dict[str, list[str]] = {
    "treepo": ["allocation.name=treepo"],
    # The shipped demo config (root head + token bag, lr 3e-2) and its ablations.
    "demo config": [],
    "demo config: constant": ["predictor.updates_per_step=0"],
    "demo config without the token bag": ["predictor.root_token_bag=false"],
    "demo config without the token bag at lr 1e-2 (previous)": ["predictor.root_token_bag=false", "predictor.lr=1e-2"],
    "demo config: prefix share 6%": ["predictor.prefix_sample_fraction=0.06"],
    "demo config: prefix share 25%": ["predictor.prefix_sample_fraction=0.25"],
    "demo config: prefix share 50%": ["predictor.prefix_sample_fraction=0.5"],
    "constant": [*OLD, *ANCHOR, "predictor.updates_per_step=0"],
    "zero-init head (old)": OLD,
    "+ anchor at mean": [*OLD, *ANCHOR],
    "+ replay 4 (decay 0.7)": [*OLD, *ANCHOR, *REPLAY],
    "+ replay 4 + lr 3e-3 (demo default)": [*OLD, *ANCHOR, *REPLAY, "predictor.lr=3e-3"],
    "+ weight decay 0.1 + lr 1e-2": [*OLD, *ANCHOR, *REPLAY, "predictor.weight_decay=0.1", "predictor.lr=1e-2"],
    "+ replay 8 (decay 0.8)": [*OLD, *ANCHOR, "predictor.replay_steps=8", "predictor.replay_decay=0.8"],
    "+ replay 4 + 16 updates at lr 1e-2": [
        *OLD,
        *ANCHOR,
        *REPLAY,
        "predictor.lr=1e-2",
        "predictor.updates_per_step=16",
    ],
    # The seed papers' question: the share of prefix samples in the predictor's loss (paper ≈ 6%).
    "prefix share 6%": [*OLD, *ANCHOR, *REPLAY, "predictor.prefix_sample_fraction=0.06"],
    "prefix share 25%": [*OLD, *ANCHOR, *REPLAY, "predictor.prefix_sample_fraction=0.25"],
    "prefix share 50%": [*OLD, *ANCHOR, *REPLAY, "predictor.prefix_sample_fraction=0.5"],
    "small_model + anchor + replay 4": [
        *OLD,
        *ANCHOR,
        *REPLAY,
        "predictor.backend=small_model",
        "predictor.lr=3e-3",
        "predictor.updates_per_step=4",
    ],
}


# The diagnosis table (docs/results/allocation.md, "Why the value head lost to a constant, and what fixed it");
# the prefix-share rows and small_model (≈ 5x slower per step on CPU) run when named in --variants.
DEFAULT = [n for n in VARIANTS if "prefix share" not in n and not n.startswith("small_model")]

# --failures: trace with the guard ON and its predictions (for planning AND for the guard's held-out
# measurement) replaced; the predictor itself still trains on the real targets.
FAILURES = ("real", "noise", "inverted", "constant")


def _corrupt(trainer, mode: str, seed: int) -> None:
    import torch

    real, gen = trainer.predictor.predict, torch.Generator().manual_seed(seed)

    def predict(packed, nodes, hidden=None):
        v = real(packed, nodes, hidden)
        if mode == "noise":
            return torch.rand(v.shape, generator=gen).to(v)
        return 1.0 - v if mode == "inverted" else torch.full_like(v, 0.5)

    if mode != "real":
        trainer.predictor.predict = predict


def _train(
    overrides: list[str], seed: int, steps: int, out_dir: Path, failure: str = "real", checkpoint: str | None = None
) -> list[dict]:
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.telemetry import read_metrics
    from trace_mega.trainer import Trainer

    cfg = load_yaml(
        TrainConfig,
        ROOT / "configs" / "demo_cpu.yaml",
        [
            "allocation.name=trace",
            "allocation.predictor_fallback=false",
            f"steps={steps}",
            f"seed={seed}",
            f"telemetry.out_dir={out_dir}",
            "telemetry.tensorboard=false",
            "telemetry.progress_bars=false",
            *overrides,
        ],
    )
    if checkpoint is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_checkpoint=checkpoint))
    trainer = Trainer(cfg)
    _corrupt(trainer, failure, seed)
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_metrics(out_dir / "metrics.jsonl")


def _warm_start() -> str:
    """The demo's cached warm start (what `trace-mega demo` starts every arm from)."""
    from trace_mega.commands.demo import warm_start
    from trace_mega.config import TrainConfig, load_yaml

    return warm_start(load_yaml(TrainConfig, ROOT / "configs" / "demo_cpu.yaml"))


def summarise(rows: list[dict]) -> dict[str, float]:
    """Pooled held-out skill, share of steps beating the constant, effective ratio, reward, predictor time."""
    scored = [
        r
        for r in rows
        if r.get("predictor/skill", math.nan) == r.get("predictor/skill", math.nan) and "predictor/brier" in r
    ]
    b = sum(r["predictor/brier"] * r["predictor/samples"] for r in scored)
    c = sum(r["predictor/brier_constant"] * r["predictor/samples"] for r in scored)
    mean = lambda k: statistics.fmean(r[k] for r in rows if k in r)  # noqa: E731
    return {
        "skill": 1.0 - b / c if c > 0 else math.nan,
        "steps_better": statistics.fmean(r["predictor/skill"] > 0 for r in scored) if scored else math.nan,
        "effective_ratio": mean("alloc/effective_ratio"),
        "reward": mean("reward/mean"),
        "predictor_share": mean("time/predictor_s") / mean("time/step_s"),
        "fallback": mean("alloc/fallback"),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "bench_predictor.json")
    ap.add_argument("--steps", type=int, default=30, help="trainer steps per run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per variant (0..seeds-1)")
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT),  # argparse %-formats help strings
        help=("comma-separated subset of: " + ", ".join(VARIANTS)).replace("%", "%%"),
    )
    ap.add_argument(
        "--failures",
        action="store_true",
        help="instead: treepo vs trace with the guard on and its predictions replaced by " + " / ".join(FAILURES[1:]),
    )
    ap.add_argument(
        "--from-scratch",
        action="store_true",
        help="start every run from a random init instead of the demo's warm start",
    )
    args = ap.parse_args(argv)
    checkpoint = None if args.from_scratch else _warm_start()
    if args.failures:
        runs = {
            "treepo": (VARIANTS["treepo"], "real"),
            **{f"trace, {f} predictions": (["allocation.predictor_fallback=true"], f) for f in FAILURES},
        }
    else:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
        runs = {n: (VARIANTS[n], "real") for n in names}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (overrides, failure) in runs.items():
            per_seed = [
                summarise(_train(overrides, s, args.steps, Path(tmp) / f"{len(results)}_{s}", failure, checkpoint))
                for s in range(args.seeds)
            ]
            results[name] = {k: statistics.fmean(p[k] for p in per_seed) for k in per_seed[0]} | {
                "per_seed": per_seed,
                "overrides": overrides,
                "predictions": failure,
            }
            print(
                f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name].items() if isinstance(v, float)),
                flush=True,
            )
    rows = [{"variant": n, **{k: v for k, v in r.items() if isinstance(v, float)}} for n, r in results.items()]
    for r in rows:
        r["pred_pct"] = 100.0 * r["predictor_share"]
    print_table(
        rows,
        [
            ("variant", "variant", "<"),
            ("skill", "skill", "+.3f"),
            ("steps_better", "steps>0", ".2f"),
            ("effective_ratio", "eff", ".3f"),
            ("reward", "reward", ".3f"),
            ("fallback", "fallback", ".2f"),
            ("pred_pct", "pred%", ".1f"),
        ],
        title=f"demo_cpu, trace with the guard {'on' if args.failures else 'off'}, {args.steps} steps x "
        f"{args.seeds} seeds (means over seeds)",
    )
    result = {"command": command_line(__file__, argv), "steps": args.steps, "seeds": args.seeds, "variants": results}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
