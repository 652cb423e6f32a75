"""`trace-mega demo | train | eval | bench`.

* `demo`  — the embedded default: a tiny GPT policy on a learnable synthetic
  environment, on CPU, `uniform` GRPO vs `trace` at equal rollout budget, with
  a Markdown + PNG report.
* `train --config FILE [key=value ...]` — one training run (under torchrun for
  TP/PP/EP/DP: `torchrun --nproc-per-node 2 -m trace_mega.cli train ...`).
* `eval --config FILE` — success rate of the current (or a checkpointed) policy.
* `bench NAME [args]` — runs `benchmarks/bench_NAME.py` of this checkout.
* `plan --config FILE` — per-GPU memory of the config on its cluster; exits 1
  naming the field when it cannot fit.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_names() -> list[str]:
    """NAME of every benchmarks/bench_NAME.py of this checkout."""
    return sorted(p.stem[len("bench_"):] for p in BENCH_DIR.glob("bench_*.py"))


def load_benchmark(name: str):
    """Import benchmarks/bench_NAME.py as module `bench_NAME` (its `main(argv) -> dict` runs it).

    benchmarks/ goes on sys.path first, as when the file runs as a script, so the
    benchmark finds its shared `harness` module.
    """
    path = BENCH_DIR / f"bench_{name}.py"
    if not path.is_file():
        raise KeyError(f"unknown benchmark {name!r}; valid names: {', '.join(benchmark_names())} "
                       f"(looked in {BENCH_DIR})")
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: trace-mega bench NAME [options]; NAME is one of: {', '.join(benchmark_names())}")
        return 0 if argv else 2
    try:
        module = load_benchmark(argv[0])
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    module.main(argv[1:])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="trace-mega", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_demo = sub.add_parser("demo", help="tiny CPU run: uniform GRPO vs TRACE at equal budget, with a report")
    p_demo.add_argument("--out", default="runs/demo", help="output directory of the report")
    p_demo.add_argument("--config", default=None, help="base config (default: configs/demo_cpu.yaml)")
    p_demo.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=5")
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("--config", required=True)
    p_train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. allocation.name=uniform")
    p_eval = sub.add_parser("eval", help="evaluate the policy of a config (from its checkpoint if any)")
    p_eval.add_argument("--config", required=True)
    p_eval.add_argument("--split", default="test")
    p_eval.add_argument("overrides", nargs="*")
    p_plan = sub.add_parser("plan", help="per-GPU memory of a config on its cluster (fails naming the field)")
    p_plan.add_argument("--config", required=True)
    p_plan.add_argument("--nodes", type=int, default=None, help="override cluster.nodes")
    p_plan.add_argument("--gpus-per-node", type=int, default=None, help="override cluster.gpus_per_node")
    p_plan.add_argument("--gpu-memory-gib", type=float, default=None, help="override cluster.gpu_memory_gib")
    p_plan.add_argument("overrides", nargs="*")
    sub.add_parser("bench", help="run benchmarks/bench_NAME.py (trace-mega bench NAME --help)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from trace_mega.config import ConfigError, TrainConfig, load_yaml

    try:
        if args.cmd == "demo":
            from trace_mega.demo import run_demo

            run_demo(out_dir=args.out, config_path=args.config, overrides=args.overrides)
            return 0
        cfg = load_yaml(TrainConfig, args.config, args.overrides)
        if args.cmd == "plan":
            from trace_mega.plan import format_plan, plan_memory, replace_cluster

            cfg = replace_cluster(cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                  gpu_memory_gib=args.gpu_memory_gib)
            plan = plan_memory(cfg)
            print(format_plan(cfg, plan))
            return 1 if plan.errors else 0
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    from trace_mega.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        if args.cmd == "train":
            trainer.train()
        else:
            print(trainer.evaluate(args.split))
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
