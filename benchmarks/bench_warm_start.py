"""The allocation demo's starting policies, per task kind: success of the transcript walker, of
the warm start trained on its transcripts, and of a random init (what `--from-scratch` starts from).

RL of a real LLM starts from a model that solves the easy prompts and not the hard ones
(paper Fig. 2a: under uniform sampling most groups are all-0 or all-1). This measures how
close the demo's start is to that on its own environment (`configs/demo_cpu.yaml`,
`synthetic_tools`: dry, `ice N` or walled off, the goal k cells away; train and test tasks),
sampling `--samples` episodes per task at the demo's rollout settings:

* `dry 1`, `ice7 1`, `wall 1`, ... — success rate of each task kind present (level, distance);
* `mean` — over every task; `contrast@4` — the expected share of prompts with a success
  and a failure among 4 rollouts, 1 - p^4 - (1-p)^4 averaged over tasks (uniform's
  expected effective ratio at this policy).

The warm start is the demo's (`trace-mega pretrain --config pretrain_tools`, trained now if
not cached) unless `--checkpoint DIR` names another HF checkpoint.

    python benchmarks/bench_warm_start.py [--samples 32] [--checkpoint DIR] [--json PATH]
    trace-mega bench warm_start [same options]
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

from harness import RESULTS, ROOT, command_line, parser, print_table, write_json


def kind(task) -> str:
    """`dry_1`, `ice7_2`, `wall_1`: the task's level as its prompt states it, and its distance."""
    from trace_mega.envs.synthetic import SyntheticToolsEnv

    return f"{SyntheticToolsEnv.kind(task)}_{abs(task.meta['goal'] - task.meta['start'])}"


def _per_task(agent, tasks, samples: int, seed: int) -> list[tuple[str, list[float]]]:
    out = []
    for s in range(0, len(tasks), 8):
        batch = tasks[s : s + 8]
        trees = agent.rollout(batch, [samples] * len(batch), seed=seed + s)
        agent.release(trees)
        out += [(kind(t), tree.leaf_rewards()) for t, tree in zip(batch, trees)]
    return out


def _row(name: str, per_task) -> dict:
    row: dict = {"policy": name}
    for key in dict.fromkeys(k for k, _ in per_task):  # the kinds in task order
        row[key] = statistics.fmean(r for k, rs in per_task if k == key for r in rs)
    ps = [statistics.fmean(rs) for _, rs in per_task]
    row["mean"] = statistics.fmean(ps)
    row["contrast_at_4"] = statistics.fmean(1 - p**4 - (1 - p) ** 4 for p in ps)
    return row


def measure_policy(cfg, samples: int, seed: int) -> list:
    """(kind, rewards) per task of the trainer's own agent (its engine holds `cfg`'s policy)."""
    from trace_mega.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        tasks = trainer.env.tasks("train") + trainer.env.tasks("test")
        return _per_task(trainer.rollouts.agent, tasks, samples, seed)
    finally:
        trainer.close()


def measure_walker(cfg, pcfg, samples: int, seed: int) -> list:
    """(kind, rewards) per task of the transcript walker itself, on the demo's env and rollout settings."""
    from trace_mega.commands.pretrain import WalkTranscriptEngine
    from trace_mega.envs import build_env
    from trace_mega.rollout.agent_loop import AgentLoop

    env = build_env(cfg.env.name, **cfg.env.options)
    with AgentLoop(env, WalkTranscriptEngine(env.tokenizer, pcfg), env.tokenizer, cfg.rollout) as loop:
        return _per_task(loop, env.tasks("train") + env.tasks("test"), samples, seed)


def main(argv: list[str] | None = None) -> dict:
    from trace_mega.commands.demo import warm_start
    from trace_mega.commands.pretrain import PretrainConfig
    from trace_mega.config import TrainConfig, load_yaml

    ap = parser(__doc__, RESULTS / "bench_warm_start.json")
    ap.add_argument("--samples", type=int, default=32, help="episodes per task")
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint of the warm policy (default: the demo's)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = load_yaml(
            TrainConfig, ROOT / "configs" / "demo_cpu.yaml", [f"telemetry.out_dir={tmp}", "telemetry.tensorboard=false"]
        )
        pcfg = load_yaml(PretrainConfig, ROOT / "configs" / "pretrain_tools.yaml")
        checkpoint = args.checkpoint or warm_start(base)
        with_model = lambda ckpt: dataclasses.replace(  # noqa: E731
            base, model=dataclasses.replace(base.model, hf_checkpoint=ckpt)
        )
        rows = [
            _row("transcript walker", measure_walker(base, pcfg, args.samples, seed=1)),
            _row("warm start", measure_policy(with_model(checkpoint), args.samples, seed=1)),
            _row("random init", measure_policy(with_model(None), args.samples, seed=1)),
        ]
    kinds = [k for k in rows[0] if k not in ("policy", "mean", "contrast_at_4")]
    print_table(
        rows,
        [
            ("policy", "policy", "<"),
            *((k, k.replace("_", " "), ".3f") for k in kinds),
            ("mean", "mean", ".3f"),
            ("contrast_at_4", "contrast@4", ".3f"),
        ],
        title=f"demo env, {args.samples} samples per task, checkpoint {Path(checkpoint).name}",
    )
    result = {
        "rows": rows,
        "checkpoint": str(checkpoint),
        "samples": args.samples,
        "command": command_line(__file__, argv),
    }
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
