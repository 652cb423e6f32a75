"""`RolloutCollector`: a training step's rollouts, spread over the rollout replicas.

Every data-parallel replica of the learner rolls out its own share of the
step's prompts (`trace_mega/rollout/replicas.py`: the layout, the
assignment, the exchange): its leader rank runs the agent loop on its engine
for the prompts `assign_prompts` gives it, branches the continuations planned
from its own trees, and after each phase the trees are all-gathered: both phases
return every tree of the step on every rank, so the trainer's step record and
its layout are identical on every rank and the allocation decisions are global
and exact. Episode seeds
come from (step, prompt index, rollout / branch, turn) (`AgentLoop`), so the
trees do not depend on the number of replicas. The bare rollouts run in the
allocator's rounds (`roll_out_rounds`: one round, except where `dapo` refills
with fresh prompts once it has seen the rewards). The collector also pauses the
engine while the learner trains and reports the step's agent-loop counters:
totals over replicas plus per-replica spread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from trace_mega.allocation import Allocator
from trace_mega.config import RolloutConfig
from trace_mega.envs.base import Env, Task
from trace_mega.rollout.agent_loop import AgentLoop, RolloutStats
from trace_mega.rollout.engines import Engine
from trace_mega.rollout.react import ReactScaffold
from trace_mega.rollout.replicas import ReplicaLayout, assign_prompts, exchange, replica_admission, stats_delta
from trace_mega.rollout.tree import RolloutTree

log = logging.getLogger("trace_mega")


class RolloutCollector:
    """The agent loop of this rank's replica (on the ranks that have an `engine`), trees shared by all ranks."""

    def __init__(
        self,
        env: Env,
        engine: Optional[Engine],
        tokenizer: Any,
        cfg: RolloutConfig,
        *,
        tool_timeout_s: float,
        max_concurrent_tool_calls: Optional[int] = None,
        max_tool_calls_per_turn: int = 8,
        layout: Optional[ReplicaLayout] = None,
    ) -> None:
        self.env, self.engine = env, engine
        self.layout = layout or ReplicaLayout.single()
        self.scaffold = ReactScaffold(tokenizer)
        admission = replica_admission(self.layout, engine is not None)  # collective
        self.agent = (
            AgentLoop(
                env,
                engine,
                tokenizer,
                cfg,
                tool_timeout_s=tool_timeout_s,
                max_concurrent_tool_calls=max_concurrent_tool_calls,
                max_tool_calls_per_turn=max_tool_calls_per_turn,
                admission=admission,
            )
            if engine is not None
            else None
        )
        self.tree_replica: list[int] = []
        """Replica that owns each of the step's trees (after `roll_out`)."""
        self.prompt_replica: list[int] = []
        """Replica that rolled out each tree of the last `roll_out` call (-1: none)."""
        self._mine: dict[int, RolloutTree] = {}
        self._replica_stats: list[dict[str, float]] = []

    def begin_step(self, seed: int) -> None:
        """Reseed the environment (a resumed run replays the same episodes) and start the step's counters."""
        self.env.reseed(seed)
        self._replica_stats = [{} for _ in range(self.layout.num_replicas)]

    def prompt_ids(self, tasks: list[Task]) -> list[list[int]]:
        """Token ids of each task's prompt, exactly as the agent loop sends it to the engine."""
        return [self.scaffold.prompt_ids(t) for t in tasks]

    def roll_out(
        self, tasks: Sequence[Task], trees: list[RolloutTree], counts: Sequence[int], seed: int
    ) -> list[RolloutTree]:
        """The step's root-only `trees` (one per task), tree i grown by `counts[i]` bare rollouts on the
        replica `assign_prompts` gives it; the same on every rank. A tree given none comes back as it
        was: it leaves the step, and the trees after this phase are those with `counts[i] > 0`, in order
        (the numbering `expand` takes)."""
        counts = [int(c) for c in counts]
        owner = assign_prompts(counts, self.layout.num_replicas)
        ids = [i for i, r in enumerate(owner) if r == self.layout.replica]
        if not ids and self.layout.leader:
            log.info("replica %d (rank %d) has no prompts this step", self.layout.replica, self.layout.rank)

        def run() -> dict[int, RolloutTree]:
            grown = self.agent.rollout([tasks[i] for i in ids], [counts[i] for i in ids], seed=seed, keys=ids)
            return dict(zip(ids, grown))

        out = self._phase(trees, run)
        self.prompt_replica = owner
        self._hold(out, owner, [i for i, m in enumerate(counts) if m > 0])
        return out

    def roll_out_rounds(
        self,
        tasks: Sequence[Task],
        trees: list[RolloutTree],
        m: torch.Tensor,
        allocator: Allocator,
        seed: int,
        generator: Optional[torch.Generator] = None,
    ) -> tuple[list[RolloutTree], torch.Tensor, list[int]]:
        """The step's bare rollouts in the allocator's rounds: `m` (B,) on the root-only `trees` (one
        `roll_out`), then, while `allocator.plan_refill` plans more from the rewards so far, the next
        round on the candidates it names. Returns the trees (one per candidate), the rollouts each
        candidate got over all rounds (B,) and the candidates whose trees stay (`allocator.plan_keep`,
        the `keep` of `StepBatch.grow`). Every allocator but `dapo` has one round and keeps every
        candidate it served. The plans read only the exchanged trees and the step's generator, and
        episodes are seeded by candidate index (`roll_out`), so the rounds and their trees are the
        same on every rank and for any replica count."""
        owner, total, counts = [-1] * len(trees), torch.zeros_like(m), m
        while int(counts.sum()) > 0:
            trees = self.roll_out(tasks, trees, counts.tolist(), seed=seed)
            owner = [r if c > 0 else o for o, r, c in zip(owner, self.prompt_replica, counts.tolist())]
            total = total + counts
            counts = allocator.plan_refill(total, reward_spread(trees), generator)
        keep = torch.nonzero(allocator.plan_keep(total, reward_spread(trees))).flatten().tolist()
        self._hold(trees, owner, keep)
        return trees, total, keep

    def _hold(self, trees: list[RolloutTree], owner: Sequence[int], keep: Sequence[int]) -> None:
        """Which replica holds each tree that stays (`keep`, renumbered in order as `expand` numbers
        them), and this replica's own tree objects (they carry the states continuations branch from)."""
        self.tree_replica = [owner[i] for i in keep]
        self._mine = {t: trees[i] for t, i in enumerate(keep) if owner[i] == self.layout.replica}

    def expand(self, trees: list[RolloutTree], points: Sequence[tuple[int, int, int]], seed: int) -> list[RolloutTree]:
        """`trees` (the kept trees of `roll_out`, in its order) with the continuations `points` (tree,
        node, k) branched, each on the replica that holds the tree (and its environment states)."""
        own = sorted(self._mine)
        local = {t: j for j, t in enumerate(own)}
        mine = [(local[t], n, k) for t, n, k in points if t in local]

        def run() -> dict[int, RolloutTree]:
            grown = [self._mine[t] for t in own]
            self.agent.expand(grown, mine, seed=seed)
            AgentLoop.release(grown)  # no more branching this step: drop the kept env states
            return dict(zip(own, grown))

        return self._phase(trees, run)

    def _phase(self, trees: list[RolloutTree], run: Callable[[], dict[int, RolloutTree]]) -> list[RolloutTree]:
        """Run this replica's part of a phase (where there is an agent), then exchange trees, counters
        and errors with every rank (`replicas.exchange`)."""
        mine, error = {}, None
        before = dataclasses.replace(self.agent.stats) if self.agent else RolloutStats()
        t0 = time.perf_counter()
        if self.agent is not None:
            try:
                mine = run()
            except Exception as exc:  # noqa: BLE001  (reported to every rank by the exchange, then raised)
                error = f"{type(exc).__name__}: {exc}"
        stats = stats_delta(self.agent.stats, before) if self.agent else {}
        if self.agent is not None and error is None:
            stats["inflight_max"] = float(self.agent.last_stats.inflight_max)  # a peak, not a counter
        stats["seconds"] = time.perf_counter() - t0
        out, per_replica = exchange(self.layout, trees, mine, stats, error)
        for acc, new in zip(self._replica_stats, per_replica):
            for k, v in new.items():
                acc[k] = max(acc.get(k, 0.0), v) if k == "inflight_max" else acc.get(k, 0.0) + v
        return out

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
        """This step's agent-loop counters (bare rollouts + continuations), summed over replicas (the
        same on every rank and for any replica count), and the per-replica spread."""
        per = self._replica_stats
        if not per or not any(per):
            return {}

        def total(k: str) -> float:
            return float(sum(s.get(k, 0.0) for s in per))

        traj = [s.get("episodes", 0.0) for s in per]
        gen = [s.get("generated_tokens", 0.0) for s in per]
        return {
            "rollout/generated_tokens": total("generated_tokens"),
            "rollout/prefill_tokens_saved": total("cached_prefix_tokens"),
            "rollout/prefix_tokens": total("prefix_tokens"),
            "rollout/tool_calls": total("tool_calls"),
            "rollout/parse_errors": total("parse_errors"),
            "rollout/tool_timeouts": total("tool_timeouts"),
            "rollout/truncated": total("truncated_episodes"),
            "rollout/generate_s": total("generate_s"),
            "rollout/tool_s": total("tool_s"),
            # Where the phase's time goes (docs/rollout.md "Scheduling"): the engine's busy share of
            # the replicas' phase time, episodes' summed wait for their tools, the slowest replica's
            # tail (90% -> 100% of its episodes ended, both phases), the most requests in one engine.
            "rollout/engine_busy_frac": total("engine_busy_s") / max(total("phase_s"), 1e-9),
            "rollout/tool_wait_s": total("tool_wait_s"),
            "rollout/tail_s": max(s.get("tail_s", 0.0) for s in per),
            "rollout/inflight_max": max(s.get("inflight_max", 0.0) for s in per),
            "rollout/replicas": float(len(per)),
            "rollout/replicas_generating": float(sum(t > 0 for t in traj)),
            "rollout/replica_trajectories_min": min(traj),
            "rollout/replica_trajectories_max": max(traj),
            "rollout/replica_generated_tokens_min": min(gen),
            "rollout/replica_generated_tokens_max": max(gen),
            "rollout/replica_seconds_max": max(s.get("seconds", 0.0) for s in per),
        }

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.engine is not None:
            self.engine.close()


def reward_spread(trees: Sequence[RolloutTree]) -> torch.Tensor:
    """(len(trees),) float64: max - min of each tree's leaf rewards (0 for a tree without leaves)."""
    rewards = [t.leaf_rewards() for t in trees]
    return torch.tensor([max(r) - min(r) if r else 0.0 for r in rewards], dtype=torch.float64)
