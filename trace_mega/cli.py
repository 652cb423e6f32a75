"""`trace-mega demo | demo credit | pretrain | train | eval | bench`.

* `demo`  — the embedded default: a tiny GPT policy on a learnable synthetic
  environment, on CPU, `uniform` GRPO vs `trace` at equal rollout budget, with
  a Markdown + PNG report.
* `demo credit` — TRACE-C on `synthetic_search` from the cached warm start:
  grpo, grpo+credit, tree, tree+credit at equal budget, 3 seeds, a report.
* `pretrain [--config FILE] [key=value ...]` — the cached warm start (an HF
  checkpoint directory, printed) that `model.hf_checkpoint` can name.
* `train --config FILE [key=value ...]` — one training run (under torchrun for
  TP/PP/EP/DP: `torchrun --nproc-per-node 2 -m trace_mega.cli train ...`).
* `eval --config FILE` — success rate of the current (or a checkpointed) policy.
* `bench NAME [args]` — runs `benchmarks/bench_NAME.py` of this checkout.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(argv: list[str]) -> int:
    names = sorted(p.stem[len("bench_"):] for p in BENCH_DIR.glob("bench_*.py"))
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: trace-mega bench NAME [options]; NAME is one of: {', '.join(names)}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    path = BENCH_DIR / f"bench_{name}.py"
    if not path.is_file():
        print(f"unknown benchmark {name!r}; valid names: {', '.join(names)} (looked in {BENCH_DIR})", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(rest)
    return 0


def _credit_demo(argv: list[str]) -> int:
    from trace_mega.config import ConfigError
    from trace_mega.credit_demo import METHODS, run_credit_demo

    p = argparse.ArgumentParser(prog="trace-mega demo credit",
                                description="TRACE-C vs outcome-only credit on synthetic_search, from the warm start")
    p.add_argument("--out", default="runs/credit_demo", help="output directory of the report")
    p.add_argument("--config", default=None, help="base config (default: configs/credit_demo.yaml)")
    p.add_argument("--pretrain-config", default=None, help="warm start (default: configs/pretrain_search.yaml)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--threshold", type=float, default=0.8, help="reward threshold of steps_to_threshold")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the base config, e.g. steps=10")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        run_credit_demo(args.out, args.config, args.pretrain_config, args.overrides,
                        seeds=[int(s) for s in args.seeds.split(",")], methods=args.methods.split(","),
                        threshold=args.threshold)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    return 0


def _pretrain(argv: list[str]) -> int:
    from trace_mega.config import ConfigError, PretrainConfig, load_yaml
    from trace_mega.pretrain import pretrain

    p = argparse.ArgumentParser(prog="trace-mega pretrain", description="the cached warm start (HF checkpoint)")
    p.add_argument("--config", default=None, help="PretrainConfig YAML (default: configs/pretrain_search.yaml)")
    p.add_argument("--force", action="store_true", help="retrain even when the cache has this config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=100")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from trace_mega.credit_demo import DEFAULT_PRETRAIN

    try:
        cfg = load_yaml(PretrainConfig, args.config or DEFAULT_PRETRAIN, args.overrides)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    print(pretrain(cfg, force=args.force))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv[:2] == ["demo", "credit"]:
        return _credit_demo(argv[2:])
    if argv and argv[0] == "pretrain":
        return _pretrain(argv[1:])
    parser = argparse.ArgumentParser(prog="trace-mega", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_demo = sub.add_parser("demo", help="tiny CPU run: uniform GRPO vs TRACE at equal budget, with a report "
                                         "(`demo credit`: TRACE-C; trace-mega demo credit --help)")
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
    sub.add_parser("bench", help="run benchmarks/bench_NAME.py (trace-mega bench NAME --help)")
    sub.add_parser("pretrain", help="the cached warm start for synthetic_search (trace-mega pretrain --help)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from trace_mega.config import ConfigError, TrainConfig, load_yaml

    try:
        if args.cmd == "demo":
            from trace_mega.demo import run_demo

            run_demo(out_dir=args.out, config_path=args.config, overrides=args.overrides)
            return 0
        cfg = load_yaml(TrainConfig, args.config, args.overrides)
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
