"""End-to-end step throughput of the trainer, per method, at equal trajectory budget.

Each variant is a real `trace-mega train` process on the CPU demo config
(`synthetic_tools`, tiny policy); the table reports seconds per step and per
phase, generated tokens per second, prefill tokens served from the prefix
cache, and the effective ratio. Variants: `uniform` (GRPO, flat groups — the
baseline), `treepo`, `trace`, `trace` with TRACE-C credit, and `trace` with
the engine's prefix reuse switched off (the no-reuse baseline for tree
rollouts).

    python benchmarks/bench_trainer.py [--steps 6] [--json PATH]
    trace-mega bench trainer [same options]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import RESULTS, ROOT, parser, print_table, write_json

VARIANTS = {
    "uniform": ["allocation.name=uniform"],
    "treepo": ["allocation.name=treepo"],
    "trace": ["allocation.name=trace"],
    "trace+credit": ["allocation.name=trace", "credit.enabled=true", "credit.answer_template=goal"],
    "trace, no prefix reuse": ["allocation.name=trace", "rollout.enable_prefix_caching=false"],
}
PHASES = ["rollout", "expand", "predictor", "credit", "train", "weight_sync"]


def _run(name: str, overrides: list[str], steps: int, out: Path) -> list[dict]:
    run_dir = out / name.replace(" ", "_").replace(",", "").replace("+", "_")
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(ROOT / "configs" / "demo_cpu.yaml"),
        f"steps={steps}",
        f"telemetry.out_dir={run_dir}",
        "telemetry.tensorboard=false",
        "telemetry.progress_bars=false",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "bench_trainer.json")
    ap.add_argument("--steps", type=int, default=6, help="steps per variant (the first is dropped as warm-up)")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            rows = _run(name, overrides, args.steps, Path(tmp))[1:] or []
            mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows) if rows else float("nan")  # noqa: E731
            step_s = mean("time/step_s")
            results[name] = {
                "step_s": step_s,
                **{f"{p}_s": mean(f"time/{p}_s") for p in PHASES},
                "generated_tok_per_s": mean("rollout/generated_tokens") / max(mean("rollout/generate_s"), 1e-9),
                "prefill_tokens_saved": mean("rollout/prefill_tokens_saved"),
                "prefix_tokens": mean("rollout/prefix_tokens"),
                "trajectories": mean("alloc/trajectories"),
                "effective_ratio": mean("alloc/effective_ratio"),
                "predictor_pct": 100.0 * mean("time/predictor_s") / step_s,
            }
    base = results["uniform"]["step_s"]
    cols = [
        "step_s",
        "rollout_s",
        "expand_s",
        "predictor_s",
        "credit_s",
        "train_s",
        "generated_tok_per_s",
        "prefill_tokens_saved",
        "trajectories",
        "effective_ratio",
        "predictor_pct",
    ]
    print_table(
        [{"variant": name, **r, "vs_uniform": r["step_s"] / base} for name, r in results.items()],
        [("variant", "variant", "<"), *((c, c, ".3f") for c in cols), ("vs_uniform", "step vs uniform", ".2f")],
    )
    out = {"steps": args.steps, "variants": results}
    write_json(out, args.json)
    return out


if __name__ == "__main__":
    main()
