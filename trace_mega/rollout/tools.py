"""Tool calls off the agent loop's critical path: each turn's calls run on a worker thread as soon
as the turn is parsed, many turns at once, each turn with its own deadline.

A turn's calls run in order on one fork of the episode state and share ONE
time budget (`timeout_s`), counted from the moment a worker starts them (a turn
waiting for a free slot loses none of it). When the budget runs out the turn
is reported as timed out and has no effect (its fork is dropped); the worker
still inside the hung call is abandoned — it starts no further call of that
turn, exits when the call returns, and a fresh worker takes its slot at once,
so a hung tool delays only its own episode.

Results are handed to the agent loop's thread through a queue and written into
the `ToolJob` by that thread only (`ToolRunner.collect`): a hung call that
returns late cannot touch a job the loop has already given up on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from trace_mega.envs.base import EpisodeState, ToolCall
from trace_mega.rollout.react import error_observation


@dataclass
class ToolJob:
    """The tool calls of one turn and, once collected, what they gave."""

    step: Callable[[EpisodeState, ToolCall], str]
    fork: EpisodeState
    calls: list[ToolCall]
    payload: Any = None
    """The caller's handle on the turn."""
    state: Optional[EpisodeState] = None
    """The state after the calls; None when they timed out (the fork must not be used then)."""
    observations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    timed_out: bool = False
    started: Optional[float] = None
    """time.monotonic() when a worker started the calls (set by the worker)."""
    done: bool = False
    """Collected (finished or timed out); a late result of a timed-out job is dropped."""

    def run(self, timeout_s: float) -> tuple[list[str], float]:
        """Run the calls in order within `timeout_s` from now: (observations, seconds)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        out = []
        for call in self.calls:
            if time.monotonic() >= deadline:  # the loop has given up on this turn: start nothing more
                break
            try:
                out.append(str(self.step(self.fork, call)))
            except Exception as exc:  # an env must not raise, but a tool bug must not kill the rollout
                out.append(error_observation(f"tool {call.name!r} failed: {type(exc).__name__}: {exc}"))
        return out, time.perf_counter() - t0


class ToolRunner:
    """At most `max_concurrent` turns' tool calls at once on daemon worker threads (started on demand).

    All bookkeeping happens on the caller's thread: it hands a job to the workers only when a
    slot is free and counts the slots; a worker only runs jobs and reports them.
    """

    def __init__(self, timeout_s: float, max_concurrent: int) -> None:
        if timeout_s <= 0 or max_concurrent < 1:
            raise ValueError(f"need timeout_s > 0 and max_concurrent >= 1, got {timeout_s}, {max_concurrent}")
        self.timeout_s, self.max_concurrent = float(timeout_s), int(max_concurrent)
        self._todo: "queue.SimpleQueue[Optional[ToolJob]]" = queue.SimpleQueue()
        self._results: "queue.SimpleQueue[tuple[ToolJob, list[str], float]]" = queue.SimpleQueue()
        self._workers = 0
        """Worker threads not abandoned (each runs at most one job at a time)."""
        self._queued: deque[ToolJob] = deque()
        """Jobs waiting for a slot."""
        self._running: list[ToolJob] = []
        """Jobs handed to the workers and not yet collected."""

    def pending(self) -> int:
        return len(self._queued) + len(self._running)

    def start(self, job: ToolJob) -> None:
        self._queued.append(job)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queued and len(self._running) < self.max_concurrent:
            job = self._queued.popleft()
            self._running.append(job)
            self._todo.put(job)
            if self._workers < len(self._running):
                self._workers += 1
                threading.Thread(target=self._work, name="tool", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            job.started = time.monotonic()
            observations, seconds = job.run(self.timeout_s)
            self._results.put((job, observations, seconds))
            if job.timed_out:  # abandoned by the loop: a fresh worker has its slot
                return

    def collect(self, wait: bool) -> list[ToolJob]:
        """The jobs that finished or ran out of time since the last call (their `observations`,
        `state`, `seconds` filled in). With `wait`, block until there is at least one (when any is open)."""
        out: list[ToolJob] = []
        while True:
            block = wait and not out and self._running
            try:
                job, observations, seconds = (
                    self._results.get(timeout=self._next_deadline()) if block else self._results.get_nowait()
                )
            except queue.Empty:
                job = None
            if job is not None and not job.done:
                job.observations, job.seconds, job.state, job.done = observations, seconds, job.fork, True
                out.append(job)
            out += self._expire()
            if job is None and (out or not block):
                break
        if out:
            self._running = [j for j in self._running if not j.done]
            self._dispatch()
        return out

    def _next_deadline(self) -> float:
        """Seconds until the first running job's budget ends (a job a worker has not started yet ends
        later than `timeout_s` from now, which bounds the wait); at least 1 ms."""
        now = time.monotonic()
        ends = [j.started + self.timeout_s for j in self._running if j.started is not None]
        return max(min(ends, default=now + self.timeout_s) - now, 1e-3)

    def _expire(self) -> list[ToolJob]:
        """Time out the running jobs whose budget is spent; their workers are abandoned."""
        now, out = time.monotonic(), []
        for job in self._running:
            if job.done or job.started is None or now < job.started + self.timeout_s:
                continue
            job.done = job.timed_out = True
            job.observations = [
                error_observation(
                    f"tool call {c.name!r} timed out after {self.timeout_s:g} s (shared by this turn's tool "
                    "calls); this turn's tool calls had no effect"
                )
                for c in job.calls
            ]
            job.seconds = self.timeout_s
            self._workers -= 1
            out.append(job)
        return out

    def close(self) -> None:
        """Let idle workers exit (hung ones finish on their own)."""
        for _ in range(self._workers):
            self._todo.put(None)
        self._workers = 0
        self._queued.clear()
        self._running = []
