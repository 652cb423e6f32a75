"""The environment contract and its registry.

An environment owns a task set and the tools of its episodes. The agent loop
(trace_mega.rollout.agent_loop) parses each model turn into a `ParsedTurn`,
calls `step` for every tool call, and `reward` at the end. Malformed turns
never reach `step`: the loop turns them into error observations itself.

Branching a continuation from an intermediate turn needs the episode state at
that turn, so states are forked with `fork` (a deep copy of the env's own
data unless the env knows better, e.g. replaying tool calls; the task and the
recorded tool calls are shared, never copied).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

from trace_mega.registry import Registry


@dataclass
class ToolCall:
    """One parsed function call; never modified after parsing (forked states share it)."""

    name: str
    arguments: dict[str, Any]
    call_id: Optional[str] = None


@dataclass
class ParsedTurn:
    """A model turn after parsing: tool calls, a final answer, or an error."""

    raw: str
    """The generated text as decoded."""
    thought: str = ""
    """Text before the action (reasoning)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    final_answer: Optional[str] = None
    error: Optional[str] = None
    """Why the turn could not be parsed (becomes an error observation)."""


@dataclass
class Task:
    """One prompt of an environment's task set."""

    task_id: str
    messages: list[dict[str, Any]]
    """Chat messages of the prompt (system + user), rendered by the tokenizer's chat template."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """JSON-schema tool descriptions offered to the model."""
    gold_answer: Optional[str] = None
    """Reference answer (rewards, TRACE-C probe)."""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpisodeState:
    """Mutable state of one episode; environments may subclass it."""

    task: Task
    data: dict[str, Any] = field(default_factory=dict)
    """Env-specific state (API simulator instances, interpreter history, …)."""
    history: list[ToolCall] = field(default_factory=list)
    """Tool calls executed so far, in order."""


class Env(ABC):
    """Base class of every environment: a task set plus reset / step / reward."""

    name: str = ""
    tokenizer: Optional[Any] = None
    """The policy tokenizer the environment ships (the synthetic environments' word-level one), or
    None: the run's tokenizer then comes with `model.hf_checkpoint`."""

    @abstractmethod
    def tasks(self, split: str = "train") -> list[Task]:
        """The task set of `split`."""

    def reset(self, task: Task) -> EpisodeState:
        """Fresh state for a new episode of `task`."""
        return EpisodeState(task=task)

    @abstractmethod
    def step(self, state: EpisodeState, call: ToolCall) -> str:
        """Execute one tool call, mutating `state`; return the observation text.

        Tool failures (bad arguments, exceptions, timeouts) are returned as
        observation text, never raised.
        """

    @abstractmethod
    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        """Terminal reward in {0, 1} (None: the episode ended without an answer)."""

    def next_turn(self, state: EpisodeState, final_answer: Optional[str]) -> Optional[list[dict[str, Any]]]:
        """After a final answer: the next user message(s) of a multi-turn task, or None when
        the task is over (then `reward` is called). Single-turn environments keep the default."""
        return None

    def fork(self, state: EpisodeState) -> EpisodeState:
        """An independent copy of `state` to branch a continuation from.

        A deep copy, except that the task and the recorded `ToolCall`s are shared
        (the copy's `history` is a new list of the same calls): the calls'
        arguments are model-written, and copying them would cost time and recurse
        on whatever nesting the model produced.
        """
        memo: dict[int, Any] = {id(state.task): state.task}
        memo.update((id(call), call) for call in state.history)
        return copy.deepcopy(state, memo)

    def turn_labels(self, tree: Any) -> Optional[list[Optional[bool]]]:
        """Ground-truth usefulness of every turn of a `RolloutTree` (per local node, None for the root), for
        measuring credit accuracy; None when the environment has no such labels (the default)."""
        return None

    def reseed(self, seed: int) -> None:
        """Reset the environment's own randomness. The agent loop calls it right before every
        `reset` / `fork` with a seed derived from the episode (trace_mega/rollout/agent_loop.py), so
        randomness drawn there depends on the episode alone, not on which episodes ran before on
        this process (rollout replicas); keep it cheap. Deterministic environments ignore it."""

    def close(self) -> None:
        """Release resources (worker processes, indices)."""


ENVS: Registry[type[Env]] = Registry("environment")
