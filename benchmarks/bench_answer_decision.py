"""Where a walk policy answers: the chance it answers ``done`` on a turn, by how far its cell is from
the goal, on the held-out tasks of `synthetic_levels` (issue #29's task set).

A turn at offset -1 starts one cell short of the goal (towards it), +0 on the goal, +1 one cell past it;
only +0 scores. `success` is the share of episodes that answer on the goal. The held-out falls of the
16-a-step runs (docs/results/allocation.md, the paragraph "What the falls are") show up here as the answer spreading
from +0 to -1 and +1. Every `--checkpoint` (an HF checkpoint: a warm start, or a run's `checkpoint.
export_hf_at_end`) is rolled out with `--samples` episodes per task at the demo config's rollout settings.

    python benchmarks/bench_answer_decision.py --checkpoint runs/pretrain_cache/60bb2e63e0239452 \
        --checkpoint runs/diag/hf [--levels 0,1] [--samples 8]
    trace-mega bench answer_decision [same options]
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter

from harness import RESULTS, ROOT, command_line, parser, print_table, write_json

OFFSETS = (-3, -2, -1, 0, 1, 2)


def answer_offsets(trees, tasks) -> tuple[Counter, Counter]:
    """(answers, turns) per offset of the turn's starting cell from the goal (negative: short of it,
    along the start-to-goal direction) over every root-to-leaf path of `trees` (one per task of
    `tasks`). A turn's cell is the last ``at N`` observation before it, the start on the first turn."""
    answers, turns = Counter(), Counter()
    for tree, task in zip(trees, tasks):
        start, goal = task.meta["start"], task.meta["goal"]
        sign = 1 if goal > start else -1
        for leaf in tree.leaves():
            cell = start
            for nid in tree.path(leaf)[1:]:
                node = tree.nodes[nid]
                offset = (cell - goal) * sign
                turns[offset] += 1
                if node.kind == "final":
                    answers[offset] += 1
                    break
                if m := re.search(r"at (\d+)", node.observation or ""):
                    cell = int(m.group(1))
    return answers, turns


def measure(checkpoint: str, levels: list[int], samples: int, seed: int = 0) -> dict:
    """{success, offset -> [P(answer), turns]} of `checkpoint` on the held-out tasks of `levels`."""
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.trainer import Trainer

    groups = {f"ice{k}" for k in levels}  # the env's eval group of a task is its level
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"model.hf_checkpoint={checkpoint}", f"telemetry.out_dir={tmp}", "telemetry.tensorboard=false"]
        trainer = Trainer(load_yaml(TrainConfig, ROOT / "configs" / "demo_headroom_b16_cpu.yaml", overrides))
        try:
            tasks = [t for t in trainer.env.tasks("test") if t.meta["benchmark"] in groups]
            trees = trainer.rollouts.agent.rollout(tasks, [samples] * len(tasks), seed=seed)
            answers, turns = answer_offsets(trees, tasks)
            rewards = [r for t in trees for r in t.leaf_rewards()]
            trainer.rollouts.agent.release(trees)
        finally:
            trainer.close()
    out = {"success": sum(rewards) / len(rewards)}
    out |= {f"{o:+d}": [answers[o] / turns[o], turns[o]] for o in OFFSETS if turns[o]}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "answer_decision.json")
    ap.add_argument("--checkpoint", action="append", required=True, help="an HF checkpoint (repeatable)")
    ap.add_argument("--levels", default="0,1", help="ice levels of the held-out tasks, comma-separated")
    ap.add_argument("--samples", type=int, default=8, help="episodes per task")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    for ckpt in args.checkpoint:
        m = measure(ckpt, levels, args.samples)
        rows.append({"checkpoint": ckpt, "success": m["success"]} | {k: v[0] for k, v in m.items() if k != "success"})
    cols = [("checkpoint", "checkpoint", "<"), ("success", "success", ".3f")]
    cols += [(f"{o:+d}", f"P(answer) at {o:+d}", ".3f") for o in OFFSETS]
    print_table(rows, cols, title=f"held-out ice {args.levels}, {args.samples} episodes per task")
    result = {"rows": rows, "levels": levels, "samples": args.samples, "command": command_line(__file__, argv)}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
