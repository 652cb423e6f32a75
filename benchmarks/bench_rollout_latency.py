"""Rollout wall time under tool latency: does an episode wait only for its own tools?

The workload is the CPU demo's (`configs/demo_cpu.yaml`): its warm-started policy
(`trace-mega pretrain --config configs/pretrain_tools.yaml`, cached; trained
first if missing), the `torch` engine, `--prompts` prompts of its
`synthetic_tools` task set with `--rollouts` bare rollouts each, at most 6
turns, one `AgentLoop.rollout` call on one process. Every tool call sleeps a
draw seeded per call (`env.options.tool_latency_ms` / `tool_latency_sigma`):
instant, fixed 50 ms, lognormal median 50 ms sigma 1, lognormal median 200 ms
sigma 1.

Per latency model: wall seconds (median of `--reps`), the process's CPU seconds (min of
`--reps`: the loop's and the engine's own work, which the load of other jobs on the machine
moves far less than the wall), the per-episode bound —
the instant wall plus the slowest episode's own summed tool time, what a
scheduler in which each episode waits only for its own tool calls would add —
wall / bound, the engine's busy fraction (share of the phase with a request
in the engine), and a digest of the trees (the same for every latency model:
scheduling changes when things happen, not what). Run it against an older
checkout with `PYTHONPATH=<checkout>` to compare loops on the same machine.

    python benchmarks/bench_rollout_latency.py [--prompts 32] [--rollouts 8] [--reps 1] [--json PATH]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DEFAULT_JSON = harness.RESULTS / "rollout_latency_cpu.json"
MODELS = {
    "instant": (0.0, 0.0),
    "fixed 50ms": (50.0, 0.0),
    "lognormal 50ms sigma 1": (50.0, 1.0),
    "lognormal 200ms sigma 1": (200.0, 1.0),
}


def _digest(trees) -> str:
    record = [[(n.token_ids, n.reward, n.parent) for n in t.nodes] for t in trees]
    return hashlib.sha1(json.dumps(record).encode()).hexdigest()[:12]


def _slowest_episode_tool_s(trees) -> float:
    """The largest summed tool time along one root-to-leaf path (one episode's own tool time)."""
    return max(sum(t.nodes[n].info.get("tool_s", 0.0) for n in t.path(leaf)) for t in trees for leaf in t.leaves())


def measure(args, latency_ms: float, sigma: float) -> dict:
    import torch

    from trace_mega.commands.demo import warm_start
    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.envs import build_env
    from trace_mega.resources import resolve_config
    from trace_mega.rollout.agent_loop import AgentLoop
    from trace_mega.rollout.engines import TorchEngine

    torch.set_num_threads(1)
    cfg = load_yaml(TrainConfig, resolve_config("demo_cpu"))
    hf = args.hf or warm_start(cfg)
    latency = {"tool_latency_ms": latency_ms, "tool_latency_sigma": sigma} if latency_ms else {}
    env = build_env(cfg.env.name, **cfg.env.options, **latency)  # instant: options an older checkout knows
    tok = env.tokenizer
    engine = TorchEngine(hf, eos_token_ids=[tok.eos_token_id])
    rc = dataclasses.replace(cfg.rollout, max_turns=args.turns)
    # A budget no draw reaches (the demo's 5 s is hit by ~1 in 1000 lognormal-200 ms draws, and a
    # draw near it times out or not with the machine's load): the table compares scheduling alone.
    loop = AgentLoop(env, engine, tok, rc, tool_timeout_s=60.0)
    tasks = (env.tasks() * (args.prompts // len(env.tasks()) + 1))[: args.prompts]
    times, cpu, trees = [], [], []
    for rep in range(args.reps + 1):  # the first is a warm-up
        engine.cache.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        trees = loop.rollout(tasks, [args.rollouts] * len(tasks), seed=1)
        if rep:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    st = loop.last_stats
    busy = getattr(st, "engine_busy_s", None)
    loop.close()
    row = {
        "wall_s": statistics.median(times),
        "times": times,
        "cpu_s": min(cpu),
        "slowest_episode_tool_s": _slowest_episode_tool_s(trees),
        "tool_calls": st.tool_calls,
        "tool_timeouts": st.tool_timeouts,
        "episodes": st.episodes,
        "digest": _digest(trees),
    }
    if busy is not None:  # an older checkout's loop does not measure it
        row["engine_busy_frac"] = busy / st.phase_s
    return row


def main(argv=None) -> dict:
    ap = harness.parser(__doc__, DEFAULT_JSON)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    ap.add_argument("--hf", default=None, help="HF checkpoint of the policy (default: the demo's warm start)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = [m.strip() for m in args.models.split(",")]
    unknown = [m for m in names if m not in MODELS]
    if unknown or "instant" not in names:
        raise SystemExit(f"--models: need 'instant' and names among {', '.join(MODELS)}; got {unknown or names}")
    rows = [{"latency": name, **measure(args, *MODELS[name])} for name in names]
    instant = next(r for r in rows if r["latency"] == "instant")
    for r in rows:
        r["bound_s"] = instant["wall_s"] + r["slowest_episode_tool_s"]
        r["wall_over_bound"] = r["wall_s"] / r["bound_s"]
    harness.print_table(
        rows,
        [
            ("latency", "tool latency", "<"),
            ("wall_s", "wall s", ".2f"),
            ("slowest_episode_tool_s", "slowest episode tools s", ".2f"),
            ("bound_s", "per-episode bound s", ".2f"),
            ("wall_over_bound", "wall / bound", ".2f"),
            ("cpu_s", "host CPU s (min)", ".2f"),
            ("engine_busy_frac", "engine busy", ".2f"),
            ("tool_calls", "tool calls", "d"),
            ("tool_timeouts", "timeouts", "d"),
            ("digest", "trees", "<"),
        ],
        title=f"rollout under tool latency: {args.prompts} prompts x {args.rollouts} rollouts, <= {args.turns} "
        f"turns, the demo's warm start, torch engine, CPU, {os.cpu_count()} cores",
    )
    result = {
        "command": harness.command_line(__file__, argv),
        "workload": {k: getattr(args, k) for k in ("prompts", "rollouts", "turns", "reps")},
        "rows": rows,
        "same_trees": len({r["digest"] for r in rows}) == 1,
    }
    harness.write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
