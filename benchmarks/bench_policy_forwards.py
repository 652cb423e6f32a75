"""Tokens through the policy's forward per trainer step, pass by pass (docs/step.md).

A forward pre-hook on the learner's policy records every call's token count
and whether it ran with grad; the table lists them per step (each no-grad
call is a pass for the predictor, the grad ones the training forward) with
their sums. It only uses `Trainer`, `trainer.learner.policy` and the metrics
sink, so it measures any checkout of the trainer the same way (docs/results/step.md
records the numbers before and after the step record).

    python benchmarks/bench_policy_forwards.py [--steps 3] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--json", default="bench_results/bench_policy_forwards.json", help="write results here ('' = do not)"
    )
    ap.add_argument("--out", default="/tmp/bench_policy_forwards", help="the runs' telemetry.out_dir")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. allocation.name=uniform")
    args = ap.parse_args(argv)
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_yaml(
        TrainConfig,
        args.config,
        [
            f"steps={args.steps}",
            f"telemetry.out_dir={args.out}",
            "telemetry.tensorboard=false",
            "telemetry.progress_bars=false",
            *args.overrides,
        ],
    )
    trainer = Trainer(cfg)
    calls: list[tuple[int, bool]] = []
    trainer.learner.policy.register_forward_pre_hook(
        lambda mod, a, kw: calls.append((int((a[0] if a else kw["input_ids"]).shape[1]), torch.is_grad_enabled())),
        with_kwargs=True,
    )
    rows = []
    real_log = trainer.sink.log

    def log(step, metrics, tag=""):
        rows.append(
            {
                "step": step,
                "allocator": tag.strip(" []"),
                "no_grad_calls": [n for n, g in calls if not g],
                "grad_calls": [n for n, g in calls if g],
                "no_grad_tokens": sum(n for n, g in calls if not g),
                "grad_tokens": sum(n for n, g in calls if g),
                "trajectories": metrics["alloc/trajectories"],
            }
        )
        calls.clear()
        return real_log(step, metrics, tag=tag)

    trainer.sink.log = log
    try:
        trainer.train()
    finally:
        trainer.close()
    print("step  allocator  no-grad passes (tokens)       training (tokens)  total")
    for r in rows:
        print(
            f"{r['step']:>4}  {r['allocator']:<9}  {str(r['no_grad_calls']):<28}  {str(r['grad_calls']):<17}  "
            f"{r['no_grad_tokens'] + r['grad_tokens']}"
        )
    result = {"config": args.config, "overrides": args.overrides, "steps": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
