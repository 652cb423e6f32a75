"""`RolloutCollector`: a training step's rollouts, across ranks.

Rank 0 hosts the engine, runs the environment episodes (the agent loop) and
expands the trees; every rank then receives the same trees, so the step
record (`trace_mega.step.StepBatch`) and its layout are identical everywhere
and the model forwards (TP collectives) line up. The collector also pauses
the engine while the learner trains and reports the step's agent-loop
counters.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

from trace_mega.config import RolloutConfig
from trace_mega.envs.base import Env, Task
from trace_mega.envs.react import ReactScaffold
from trace_mega.learner.parallel import broadcast_trees
from trace_mega.rollout.agent_loop import AgentLoop, RolloutStats
from trace_mega.rollout.engines import Engine
from trace_mega.rollout.tree import RolloutTree

if TYPE_CHECKING:
    from trace_mega.step import StepBatch


class RolloutCollector:
    """The agent loop on the rank that hosts `engine` (None elsewhere), trees shared with every rank."""

    def __init__(self, env: Env, engine: Optional[Engine], tokenizer: Any, cfg: RolloutConfig, *,
                 tool_timeout_s: float, max_tool_calls_per_turn: int = 8) -> None:
        self.env, self.engine = env, engine
        self.scaffold = ReactScaffold(tokenizer)
        self.agent = AgentLoop(env, engine, tokenizer, cfg, tool_timeout_s=tool_timeout_s,
                               max_tool_calls_per_turn=max_tool_calls_per_turn) if engine is not None else None
        self._before = RolloutStats()

    def begin_step(self, seed: int) -> None:
        """Reseed the environment (a resumed run replays the same episodes) and start the step's counters."""
        self.env.reseed(seed)
        self._before = dataclasses.replace(self.agent.stats) if self.agent else RolloutStats()

    def prompt_ids(self, tasks: list[Task]) -> list[list[int]]:
        """Token ids of each task's prompt, exactly as the agent loop sends it to the engine."""
        return [self.scaffold.prompt_ids(t) for t in tasks]

    def roll_out(self, batch: "StepBatch", seed: int) -> None:
        """`batch.rollouts[i]` bare rollouts of prompt i; the prompts given none leave the step."""
        counts = batch.rollouts.tolist()
        trees = broadcast_trees(self.agent.rollout(batch.tasks, counts, seed=seed) if self.agent else None)
        batch.grow(trees, keep=[i for i, m in enumerate(counts) if m > 0])

    def expand(self, batch: "StepBatch", seed: int) -> None:
        """Branch the planned continuations (`batch.continuations`) from the bare trees' prefixes."""
        if self.agent:
            self.agent.expand(batch.trees, batch.branch_points(), seed=seed)
            AgentLoop.release(batch.trees)  # no more branching this step: drop the kept env states
        batch.grow(broadcast_trees(batch.trees if self.agent else None))

    def rollout_tasks(self, tasks: list[Task], samples_per_task: int, seed: int) -> list[RolloutTree]:
        """`samples_per_task` bare rollouts of every task (evaluation), on every rank."""
        trees = self.agent.rollout(tasks, [samples_per_task] * len(tasks), seed=seed) if self.agent else None
        return broadcast_trees(trees)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Free the engine's accelerator memory for the duration (the learner trains meanwhile)."""
        if self.engine is not None:
            self.engine.sleep()
        try:
            yield
        finally:
            if self.engine is not None:
                self.engine.wake_up()

    def step_metrics(self) -> dict[str, float]:
        """This step's agent-loop counters (bare rollouts + continuations); empty off the hosting rank."""
        if self.agent is None:
            return {}
        now, before = dataclasses.asdict(self.agent.stats), dataclasses.asdict(self._before)
        d = {k: now[k] - before[k] for k in now}
        return {"rollout/generated_tokens": d["generated_tokens"], "rollout/prefill_tokens_saved": d["cached_prefix_tokens"],
                "rollout/prefix_tokens": d["prefix_tokens"], "rollout/tool_calls": d["tool_calls"],
                "rollout/parse_errors": d["parse_errors"], "rollout/tool_timeouts": d["tool_timeouts"],
                "rollout/truncated": d["truncated_episodes"], "rollout/generate_s": d["generate_s"],
                "rollout/tool_s": d["tool_s"]}

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.engine is not None:
            self.engine.close()
