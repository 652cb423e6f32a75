"""What trace's root plan does per task kind of the demo env: the predictor's root predictions,
the real success, and the share of the root rollouts each kind gets.

Every variant trains the demo config (`configs/demo_cpu.yaml`: `synthetic_tools` with dry,
`ice 7` and walled-off tasks, the tiny policy from the demo's warm start) with
`allocation.name=trace` for `--steps` steps on `--seed`. Over the steps from `--from-step` on,
per task kind (`SyntheticToolsEnv.kind`: dry / ice7 / wall):

* `pred` — mean root prediction over the step's candidate prompts of that kind (before rollouts);
* `real` — mean reward of the kind's trees that step (the truth the prediction aims at);
* `roots` — the kind's share of the step's root rollouts (a perfect predictor puts nearly all
  of them on `ice 7`: dry prompts give all-1 groups, walled ones all-0 groups).

Plus the run's mean effective ratio and last-10-step training reward. The root plan is read
from each step's stages (wrappers around the trainer's scoring and rollout stages, nothing
else changed).

    python benchmarks/bench_root_plan.py [--steps 60] [--seed 0] [--from-step 30] [--variants a,b] [--json PATH]
    trace-mega bench root_plan [same options]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from harness import RESULTS, ROOT, command_line, parser, print_table, write_json

KINDS = ("dry", "ice7", "wall")
PREVIOUS = ["predictor.root_token_bag=false", "predictor.lr=1e-2"]  # the previous demo's predictor
VARIANTS: dict[str, list[str]] = {
    "root head at lr 1e-2 (previous demo)": PREVIOUS,
    "root head at lr 3e-2": ["predictor.root_token_bag=false"],
    "root head with 24 updates per step": [*PREVIOUS, "predictor.updates_per_step=24"],
    "root head + token bag at lr 1e-2": ["predictor.lr=1e-2"],
    "root head + token bag at lr 3e-2 (demo config)": [],
}


def _run(overrides: list[str], seed: int, steps: int, out: Path, checkpoint: str) -> tuple[list[dict], list[dict]]:
    """(per-step plan records, metrics rows) of one trace run."""
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.envs.synthetic import SyntheticToolsEnv
    from trace_mega.telemetry import read_metrics
    from trace_mega.trainer import Trainer

    cfg = load_yaml(
        TrainConfig,
        ROOT / "configs" / "demo_cpu.yaml",
        [
            *overrides,
            "allocation.name=trace",
            f"seed={seed}",
            f"steps={steps}",
            f"telemetry.out_dir={out}",
            "telemetry.tensorboard=false",
            "telemetry.progress_bars=false",
            f"model.hf_checkpoint={checkpoint}",
        ],
    )
    trainer = Trainer(cfg)
    records: list[dict] = []
    predict, roll_out, expand = trainer._predict, trainer.rollouts.roll_out, trainer.rollouts.expand
    step: dict = {}

    def recording_predict(packed, nodes, allocator):
        v = predict(packed, nodes, allocator)
        if "v_root" not in step:  # the step's first scoring: its prompts
            step["v_root"] = v.tolist()
        return v

    def recording_roll_out(tasks, trees, counts, seed):
        step.update(tasks=list(tasks), counts=list(counts))
        return roll_out(tasks, trees, counts, seed)

    def recording_expand(trees, points, seed):
        final = expand(trees, points, seed)
        kind_of = {t.task_id: SyntheticToolsEnv.kind(t) for t in step["tasks"]}
        rec = {k: {"pred": [], "roots": 0, "real": []} for k in KINDS}
        for task, v, m in zip(step["tasks"], step["v_root"], step["counts"]):
            rec[kind_of[task.task_id]]["pred"].append(v)
            rec[kind_of[task.task_id]]["roots"] += m
        for tree in final:
            rec[kind_of[tree.prompt_id]]["real"] += tree.leaf_rewards()
        records.append(rec)
        step.clear()
        return final

    trainer._predict, trainer.rollouts.roll_out = recording_predict, recording_roll_out
    trainer.rollouts.expand = recording_expand
    try:
        trainer.train()
    finally:
        trainer.close()
    return records, read_metrics(out / "metrics.jsonl")


def summarise(records: list[dict], rows: list[dict], from_step: int) -> dict:
    window = records[from_step:]
    total = sum(r[k]["roots"] for r in window for k in KINDS) or 1
    out: dict = {}
    for k in KINDS:
        preds = [v for r in window for v in r[k]["pred"]]
        real = [x for r in window for x in r[k]["real"]]
        out[f"{k}_pred"] = statistics.fmean(preds) if preds else float("nan")
        out[f"{k}_real"] = statistics.fmean(real) if real else float("nan")
        out[f"{k}_roots"] = sum(r[k]["roots"] for r in window) / total
    out["effective_ratio"] = statistics.fmean(r["alloc/effective_ratio"] for r in rows)
    out["reward_last10"] = statistics.fmean(r["reward/mean"] for r in rows[-10:])
    return out


def main(argv: list[str] | None = None) -> dict:
    from trace_mega.commands.demo import warm_start
    from trace_mega.config import TrainConfig, load_yaml

    ap = parser(__doc__, RESULTS / "bench_root_plan.json")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-step", type=int, default=30, help="first step of the per-kind means")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
    checkpoint = warm_start(load_yaml(TrainConfig, ROOT / "configs" / "demo_cpu.yaml"))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, name in enumerate(names):
            records, rows = _run(VARIANTS[name], args.seed, args.steps, Path(tmp) / str(n), str(checkpoint))
            results[name] = summarise(records, rows, args.from_step) | {"overrides": VARIANTS[name]}
            print(
                f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name].items() if isinstance(v, float)),
                flush=True,
            )
    rows = [{"variant": n, **{k: v for k, v in r.items() if isinstance(v, float)}} for n, r in results.items()]
    print_table(
        rows,
        [
            ("variant", "variant", "<"),
            *((f"{k}_pred", f"pred {k}", ".2f") for k in KINDS),
            *((f"{k}_real", f"real {k}", ".2f") for k in KINDS),
            *((f"{k}_roots", f"roots {k}", ".2f") for k in KINDS),
            ("effective_ratio", "eff", ".3f"),
            ("reward_last10", "reward last 10", ".3f"),
        ],
        title=f"demo_cpu, trace, seed {args.seed}, steps {args.from_step}..{args.steps - 1}",
    )
    result = {
        "command": command_line(__file__, argv),
        "seed": args.seed,
        "steps": args.steps,
        "from_step": args.from_step,
        "variants": results,
    }
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
