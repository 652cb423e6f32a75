"""`trace-mega demo | demo credit | pretrain | train | eval | export | plan | bench | sweep`.

* `demo`  — the embedded default: a tiny GPT policy on a learnable synthetic
  environment, on CPU, `uniform` GRPO vs `dapo` vs `treepo` vs `trace` at equal generated
  trajectories, with a Markdown + PNG report; every arm starts from the config's cached warm
  start (`--from-scratch`: a random init). `--config demo_headroom_cpu`: the held-out
  learning-per-trajectory comparison on `synthetic_levels`; `demo_headroom_b16_cpu`: the same at
  16 trajectories a step, trace's best measured regime.
* `demo credit` — TRACE-C on `synthetic_search` from the cached warm start:
  grpo, grpo+credit, tree, tree+credit at equal budget, 3 seeds, a report.
* `pretrain [--config NAME|FILE] [key=value ...]` — the cached warm start (an HF
  checkpoint directory, printed) that `model.hf_checkpoint` can name.
* `train --config NAME|FILE [key=value ...]` — one training run (under torchrun for
  TP/PP/EP/DP: `torchrun --nproc-per-node 2 -m trace_mega train ...`).
* `eval --config NAME|FILE` — pass@k, mean@n and accuracy per benchmark of the
  current (or a checkpointed) policy, as a Markdown table and JSON.
* `export --run DIR [--step N] --out HF_DIR` — a checkpointed run as an HF checkpoint.
* `bench NAME [args]` — runs the shipped `bench_NAME.py`.
* `sweep --config NAME|FILE [--steps N] KEY=V1,V2 ...` — one short run per grid point
  (`nproc=1,2`: processes per point, under torchrun), one table and plot.
* `plan --config NAME|FILE` — per-GPU memory of the config on its cluster;
  exits 1 naming the field when it cannot fit.

`--config` takes a YAML path or the name of a shipped config (`demo_cpu`,
`qwen3_14b_multihop`, `qwen3_30b_a3b_bfcl`). The console shows the step lines,
progress bars and warnings; library logs go to `<run dir>/<command>.log`
(and to the console with `--verbose`).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

log = logging.getLogger("trace_mega")


def benchmark_names() -> list[str]:
    """NAME of every shipped bench_NAME.py."""
    from trace_mega.resources import benchmarks

    return list(benchmarks())


def load_benchmark(name: str):
    """Import the shipped bench_NAME.py as module `bench_NAME` (its `main(argv) -> dict` runs it).

    Its directory goes on sys.path first, as when the file runs as a script, so the
    benchmark finds its shared `harness` module.
    """
    from trace_mega.resources import benchmarks

    found = benchmarks()
    if name not in found:
        raise KeyError(f"unknown benchmark {name!r}; valid names: {', '.join(found)}")
    path = found[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _bench(argv: list[str]) -> int:
    """Run a shipped benchmark as `python benchmarks/bench_NAME.py ARGS` would."""
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


def _ks(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also print library logs (Megatron, transformers, vLLM) and their warnings",
    )
    parser = argparse.ArgumentParser(prog="trace-mega", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "demo",
        parents=[common],
        help="tiny CPU run: uniform GRPO vs DAPO vs TreePO vs TRACE at equal budget, with a report",
    )
    p.add_argument("--out", default="runs/demo", help="output directory of the report")
    p.add_argument("--seeds", type=int, default=1, help="seeds per method, run one after the other (default 1)")
    p.add_argument(
        "--config", default="demo_cpu", help="base config, a shipped name or a YAML path (default: demo_cpu)"
    )
    p.add_argument(
        "--pretrain-config",
        default=None,
        help="warm start's transcript policy (default: the config's own, pretrain_tools for demo_cpu, "
        "pretrain_levels for demo_headroom_cpu and demo_headroom_b16_cpu; its env and model are the demo's)",
    )
    p.add_argument("--methods", default=None, help="comma-separated arms (default: uniform,dapo,treepo,trace)")
    p.add_argument("--from-scratch", action="store_true", help="no warm start: every run starts from a random init")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=5")
    p = sub.add_parser("train", parents=[common], help="train from a config")
    p.add_argument("--config", required=True, help="a shipped config name (demo_cpu, ...) or a YAML path")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. allocation.name=uniform")
    p = sub.add_parser(
        "eval", parents=[common], help="pass@k / mean@n per benchmark of a config's policy (from its checkpoint if any)"
    )
    p.add_argument("--config", required=True, help="a shipped config name or a YAML path")
    p.add_argument("--split", default=None, help="task split (default: eval.split)")
    p.add_argument("--samples", type=int, default=None, help="n: samples per task (default: eval.samples_per_task)")
    p.add_argument(
        "--k", type=_ks, default=None, help="comma-separated k of pass@k, each <= n (default: 1, 2, 4, ..., n)"
    )
    p.add_argument("--max-tasks", type=int, default=None, help="evaluate only the first N tasks")
    p.add_argument("--out", default=None, help="directory of <split>.json / <split>.md (default: <out_dir>/eval)")
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("export", parents=[common], help="write a checkpointed run as an HF checkpoint")
    p.add_argument("--run", required=True, help="the run's checkpoint.dir, or its telemetry.out_dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--out", required=True, help="HF checkpoint directory to write")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to rebuild the model")
    p = sub.add_parser(
        "plan", parents=[common], help="per-GPU memory of a config on its cluster (fails naming the field)"
    )
    p.add_argument("--config", required=True, help="a shipped config name or a YAML path")
    p.add_argument("--nodes", type=int, default=None, help="override cluster.nodes")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override cluster.gpus_per_node")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="override cluster.gpu_memory_gib")
    p.add_argument("overrides", nargs="*")
    sub.add_parser("bench", help="run the shipped benchmarks/bench_NAME.py (trace-mega bench NAME --help)")
    sub.add_parser(
        "pretrain", help="the cached warm start for synthetic_search / synthetic_tools (trace-mega pretrain --help)"
    )
    sub.add_parser(
        "sweep", help="short runs over a grid of config values, one table and plot (trace-mega sweep --help)"
    )
    return parser


def _eval_overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    if args.split is not None:
        extra.append(f"eval.split={args.split}")
    if args.samples is not None:
        extra.append(f"eval.samples_per_task={args.samples}")
    if args.k is not None:
        extra.append(f"eval.ks=[{','.join(map(str, args.k))}]")
    if args.max_tasks is not None:
        extra.append(f"eval.max_tasks={args.max_tasks}")
    return args.overrides + extra


def _credit_demo(argv: list[str]) -> int:
    from trace_mega.commands.credit_demo import METHODS, run_credit_demo
    from trace_mega.config import ConfigError

    p = argparse.ArgumentParser(
        prog="trace-mega demo credit",
        description="TRACE-C vs outcome-only credit on synthetic_search, from the warm start",
    )
    p.add_argument("--out", default="runs/credit_demo", help="output directory of the report")
    p.add_argument("--config", default=None, help="base config (default: configs/credit_demo.yaml)")
    p.add_argument("--pretrain-config", default=None, help="warm start (default: configs/pretrain_search.yaml)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--threshold", type=float, default=0.8, help="reward threshold of steps_to_threshold")
    p.add_argument("--verbose", "-v", action="store_true", help="also print library logs")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the base config, e.g. steps=10")
    args = p.parse_args(argv)
    from trace_mega.logs import setup_logging

    setup_logging(verbose=args.verbose)
    try:
        run_credit_demo(
            args.out,
            args.config,
            args.pretrain_config,
            args.overrides,
            seeds=[int(s) for s in args.seeds.split(",")],
            methods=args.methods.split(","),
            threshold=args.threshold,
        )
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    return 0


def _pretrain(argv: list[str]) -> int:
    from trace_mega.commands.pretrain import PretrainConfig, pretrain
    from trace_mega.config import ConfigError, load_yaml

    p = argparse.ArgumentParser(prog="trace-mega pretrain", description="the cached warm start (HF checkpoint)")
    p.add_argument(
        "--config",
        default=None,
        help="PretrainConfig: a shipped name (pretrain_search, pretrain_tools) or a YAML path "
        "(default: pretrain_search)",
    )
    p.add_argument("--force", action="store_true", help="retrain even when the cache has this config")
    p.add_argument("--verbose", "-v", action="store_true", help="also print library logs")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=100")
    args = p.parse_args(argv)
    from trace_mega.logs import setup_logging

    setup_logging(verbose=args.verbose)
    from trace_mega.commands.credit_demo import DEFAULT_PRETRAIN
    from trace_mega.resources import resolve_config

    try:
        cfg = load_yaml(
            PretrainConfig, resolve_config(args.config) if args.config else DEFAULT_PRETRAIN, args.overrides
        )
    except (ConfigError, FileNotFoundError) as exc:
        print(f"invalid config: {exc}" if isinstance(exc, ConfigError) else str(exc), file=sys.stderr)
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
    if argv and argv[0] == "sweep":
        from trace_mega.commands.sweep import main as sweep

        return sweep(argv[1:])
    args = _parser().parse_args(argv)

    from trace_mega.logs import log_to_file, setup_logging

    setup_logging(verbose=args.verbose)
    from trace_mega.config import ConfigError, TrainConfig, load_yaml
    from trace_mega.resources import resolve_config

    try:
        if args.cmd == "export":
            from trace_mega.commands.export import export_checkpoint

            log_to_file(args.out, "export")
            export_checkpoint(args.run, args.out, step=args.step, device=args.device)
            return 0
        config = resolve_config(args.config)
        if args.cmd == "demo":
            from trace_mega.commands.demo import run_demo

            log_to_file(args.out, "demo")
            run_demo(
                out_dir=args.out,
                config_path=config,
                overrides=args.overrides,
                seeds=args.seeds,
                pretrain_config_path=args.pretrain_config and resolve_config(args.pretrain_config),
                from_scratch=args.from_scratch,
                **({"methods": tuple(m.strip() for m in args.methods.split(","))} if args.methods else {}),
            )
            return 0
        cfg = load_yaml(TrainConfig, config, _eval_overrides(args) if args.cmd == "eval" else args.overrides)
        if args.cmd == "plan":
            from trace_mega.commands.plan import format_plan, plan_memory, replace_cluster

            cfg = replace_cluster(
                cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib
            )
            plan = plan_memory(cfg)
            print(format_plan(cfg, plan))
            return 1 if plan.errors else 0
    except (ConfigError, FileNotFoundError) as exc:
        print(f"invalid config: {exc}" if isinstance(exc, ConfigError) else str(exc), file=sys.stderr)
        return 2
    log_to_file(cfg.telemetry.out_dir, args.cmd)
    from trace_mega.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        if args.cmd == "train":
            stop = trainer.train()
            if stop is not None:  # checkpointed; 75 (a signal, the clock) asks for a requeue
                if trainer.is_main:
                    print(stop.message, file=sys.stderr)
                return stop.exit_code
        else:
            report = trainer.evaluate()
            if report is not None:
                out = Path(args.out) if args.out else Path(cfg.telemetry.out_dir) / "eval"
                js, md = report.write(out, report.split)
                print(report.markdown())
                print(f"wrote {js} and {md}")
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
