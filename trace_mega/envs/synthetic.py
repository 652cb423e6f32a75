"""Synthetic environments with known success probabilities (tests, simulator, CPU demo).

Both use the tiny word-level tokenizer of `trace_mega.envs.tokenizer` (one
added token per complete tool call / final answer) and the ordinary ReAct
rendering and parsing path.

* ``synthetic`` — prompt i has a known success probability ``p_i`` drawn
  from a U-shaped Beta(a, a) (a < 1). The episode's outcome is a hidden
  uniform number U: the episode succeeds iff the model gives a final answer
  (any text) and ``U < p_i``. Each ``reveal`` tool call reveals the next
  binary digit of U, so after k reveals U is known to lie in an interval
  ``[lo, lo + 2^-k)`` and the success probability of the prefix is exactly
  ``true_value(state) = clip((p_i - lo) / 2^-k, 0, 1)`` — for ANY policy that
  eventually answers. The sequence of prefix values is a martingale, which
  makes it the reference for predictor and allocation tests.

* ``synthetic_tools`` — a learnable walk on a line of `width` cells. The
  prompt ``start S goal G`` (plus ``ice`` on slippery tasks, where each move
  fails with probability `slip`) asks the agent to move with
  ``move(dir=left|right)`` and to answer ``<answer>done</answer>`` while on the
  goal; the observation is the new cell (``at X``, ``at X wall`` when blocked
  by the edge). A tiny GPT trained from scratch can learn it (compare two
  numbers, emit one of three action tokens); a uniformly random action policy
  succeeds at a low, distance-dependent rate (`uniform_action_success`), so
  prompt success rates spread over (0, 1). Difficulty the way real prompt sets
  have it (most groups all-0 or all-1 under uniform sampling, paper Fig. 2a)
  comes from ``slip_in_prompt="level"`` with several `slips`: the prompt states
  the ice level (``ice 6``: each move fails 60% of the time), so a task near
  ``ice 9`` is nearly hopeless within a few turns; ``min_distance=0`` adds
  goal = start tasks (answer at once: trivial, but a from-scratch policy can
  settle on always answering at once, docs/results/allocation.md). The prompt carries
  the task's description, never its success probability (which also depends
  on the policy). ``walls=True`` adds the prompts no policy solves, the all-0
  groups of a real prompt set: a copy of the dry tasks whose prompt ends in
  ``wall`` — the goal cell is walled off, a move into it answers ``at X wall``
  and leaves the agent where it was. ``synthetic_levels``
  (trace_mega/envs/synthetic_levels.py) is this walk over 900 prompts with a
  held-out test split.

Each episode's randomness comes from a per-state RNG (for ``synthetic``, the
undrawn digits of U are a uniform ``tail`` drawn with it); `fork` replaces
them with fresh draws from the environment's master RNG (seeded by `seed`).
Given the revealed digits the rest of U is uniform, so redrawing it on a fork
leaves every probability above unchanged, makes continuations branched from
one prefix independent, and keeps a run reproducible.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any, Optional

from trace_mega.envs.base import ENVS, Env, EpisodeState, Task, ToolCall
from trace_mega.envs.latency import ToolLatency
from trace_mega.envs.tokenizer import build_tiny_tokenizer
from trace_mega.rollout.react import ReactScaffold

ANSWER_DONE = "<answer>done</answer>"
WORDS = ["walk", "start", "goal", "at", "wall", "ice", "task", "bit", "empty", "reveal", "move", "left", "right"]
WORDS += [str(d) for d in range(10)]


def call_token(name: str, arguments: dict[str, Any]) -> str:
    """The tool-call string registered as ONE token (Qwen3 format, standard json.dumps spacing)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


MOVE_LEFT = call_token("move", {"dir": "left"})
MOVE_RIGHT = call_token("move", {"dir": "right"})
REVEAL = call_token("reveal", {})
ACTION_TOKENS = [MOVE_LEFT, MOVE_RIGHT, REVEAL, ANSWER_DONE]
WALK_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "move one cell",
            "parameters": {
                "type": "object",
                "properties": {"dir": {"type": "string", "enum": ["left", "right"]}},
                "required": ["dir"],
                "additionalProperties": False,
            },
        },
    }
]
"""The walk's one tool (`synthetic_tools`, `synthetic_levels`); shared read-only by every task."""


def tiny_tokenizer():
    """The shared tiny tokenizer of both synthetic environments (≈35 tokens)."""
    return build_tiny_tokenizer(WORDS, ACTION_TOKENS)


def _digits(n: int) -> str:
    return " ".join(str(n))


class _SeededEnv(Env):
    """Common part: a master RNG, the tiny tokenizer, per-state RNGs reseeded on fork."""

    def __init__(self, seed: int = 0, tool_latency_ms: float = 0.0, tool_latency_sigma: float = 0.0) -> None:
        self._master = random.Random(seed)
        self.tokenizer = tiny_tokenizer()
        self.latency = ToolLatency(tool_latency_ms, tool_latency_sigma)

    def _simulate_latency(self, state: EpisodeState) -> None:
        """Sleep the call's simulated latency (`envs/latency.py`), keyed by the state's RNG position and
        call count, which it reads without drawing from it."""
        if self.latency.median_ms:
            self.latency.wait((hash(state.data["rng"].getstate()), len(state.history)))

    @functools.cached_property
    def stop_token_ids(self) -> list[int]:
        """Engine stop ids: every one-token action and the end-of-turn token."""
        return ReactScaffold(self.tokenizer).stop_token_ids

    def reseed(self, seed: int) -> None:
        self._master = random.Random(seed)

    def _new_rng(self) -> random.Random:
        return random.Random(self._master.getrandbits(64))

    def _fresh_randomness(self, data: dict[str, Any]) -> dict[str, Any]:
        """Episode randomness from now on: a new RNG (and, for `synthetic`, a new tail of U)."""
        data["rng"] = self._new_rng()
        return data

    def fork(self, state: EpisodeState) -> EpisodeState:
        # Tasks are shared read-only and the data holds scalars only, so a shallow copy is a
        # full copy; the RNG is replaced, never shared. (deepcopy here was the rollout's hot spot.)
        return EpisodeState(task=state.task, data=self._fresh_randomness(dict(state.data)), history=list(state.history))


@ENVS.register("synthetic")
class SyntheticEnv(_SeededEnv):
    """Known per-prompt success probability p_i (U-shaped) and exact per-prefix values."""

    name = "synthetic"

    def __init__(
        self,
        num_tasks: int = 64,
        beta: float = 0.5,
        num_bits: int = 4,
        seed: int = 0,
        tool_latency_ms: float = 0.0,
        tool_latency_sigma: float = 0.0,
    ) -> None:
        """`tool_latency_ms` / `tool_latency_sigma`: simulated tool latency (median ms, lognormal sigma;
        sigma 0 is a fixed delay)."""
        if num_tasks < 1 or num_bits < 0 or beta <= 0:
            raise ValueError(
                f"synthetic: need num_tasks >= 1, num_bits >= 0, beta > 0 (got {num_tasks}, {num_bits}, {beta})"
            )
        super().__init__(seed, tool_latency_ms, tool_latency_sigma)
        self.num_bits = num_bits
        draw = random.Random(seed + 1)
        self.p = [draw.betavariate(beta, beta) for _ in range(num_tasks)]
        self.tools = [
            {
                "type": "function",
                "function": {
                    "name": "reveal",
                    "description": "reveal the next binary digit of the hidden number",
                    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
                },
            }
        ]
        self._tasks = [
            Task(
                task_id=f"synthetic-{i}",
                messages=[{"role": "system", "content": "reveal"}, {"role": "user", "content": f"task {_digits(i)}"}],
                tools=self.tools,
                gold_answer="done",
                meta={"p": p},
            )
            for i, p in enumerate(self.p)
        ]

    def tasks(self, split: str = "train") -> list[Task]:
        return list(self._tasks)

    def reset(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task, data=self._fresh_randomness({"lo": 0.0, "width": 1.0, "revealed": 0}))

    def _fresh_randomness(self, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._fresh_randomness(data)
        # U = lo + width * tail: the digits not revealed yet, drawn now so reward() reads, never draws.
        data["tail"] = data["rng"].random()
        return data

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        self._simulate_latency(state)
        if call.name != "reveal":
            return f"Error: unknown tool {call.name!r}"
        d = state.data
        state.history.append(call)
        if d["revealed"] >= self.num_bits:
            return "empty"
        # The next binary digit of U is the leading digit of the tail; the rest stays uniform.
        bit = int(d["tail"] >= 0.5)
        d["tail"] = 2.0 * d["tail"] - bit
        d["width"] /= 2.0
        d["lo"] += bit * d["width"]
        d["revealed"] += 1
        return f"bit {bit}"

    def true_value(self, state: EpisodeState) -> float:
        """P(success | revealed digits) = P(U < p | U uniform in [lo, lo + width)), for a policy that answers."""
        return self.value_of(state.task.meta["p"], state.data["lo"], state.data["width"])

    @staticmethod
    def value_of(p: float, lo: float, width: float) -> float:
        return min(1.0, max(0.0, (p - lo) / width))

    def true_value_from_observations(self, task: Task, observations: list[str]) -> float:
        """`true_value` of the prefix whose turns showed `observations` (e.g. the `Node.observation`s of a
        tree path, so trees loaded from JSONL can be scored); observations other than `bit 0|1` reveal nothing."""
        lo, width = 0.0, 1.0
        for obs in observations:
            if obs in ("bit 0", "bit 1"):
                width /= 2.0
                lo += width * (obs == "bit 1")
        return self.value_of(task.meta["p"], lo, width)

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        if final_answer is None:
            return 0.0
        d = state.data
        return float(d["lo"] + d["width"] * d["tail"] < state.task.meta["p"])


@ENVS.register("synthetic_tools")
class SyntheticToolsEnv(_SeededEnv):
    """Walk to the goal cell on a line, then answer; learnable by a tiny policy from scratch."""

    name = "synthetic_tools"

    SLIP_IN_PROMPT = ("flag", "level")

    def __init__(
        self,
        width: int = 7,
        max_distance: int = 4,
        slips: tuple[float, ...] | list[float] = (0.0, 0.25),
        min_distance: int = 1,
        slip_in_prompt: str = "flag",
        walls: bool = False,
        seed: int = 0,
        tool_latency_ms: float = 0.0,
        tool_latency_sigma: float = 0.0,
    ) -> None:
        """`slips`: one copy of the task set per slip probability; `min_distance` .. `max_distance`:
        cells between start and goal (0: start on the goal); `slip_in_prompt`: ``flag`` appends
        ``ice`` to slippery prompts, ``level`` appends ``ice N`` with N = 10 * slip (slips must then
        be multiples of 0.1, so the text states the level exactly); `walls`: add one walled copy of
        the dry tasks with start != goal (``wall`` in the prompt; the goal cannot be entered);
        `tool_latency_ms` / `tool_latency_sigma`: simulated tool latency (median ms, lognormal sigma;
        sigma 0 is a fixed delay)."""
        if not 2 <= width <= 10 or not 0 <= min_distance <= max_distance < width or max_distance < 1:
            raise ValueError(
                f"synthetic_tools: need 2 <= width <= 10 and 0 <= min_distance <= max_distance < width, "
                f"max_distance >= 1 (got {width}, {min_distance}, {max_distance})"
            )
        if any(not 0.0 <= s < 1.0 for s in slips) or not slips:
            raise ValueError(f"synthetic_tools: slips must be non-empty and in [0, 1), got {list(slips)}")
        if slip_in_prompt not in self.SLIP_IN_PROMPT:
            raise ValueError(
                f"synthetic_tools: slip_in_prompt must be one of {', '.join(self.SLIP_IN_PROMPT)}, "
                f"got {slip_in_prompt!r}"
            )
        if slip_in_prompt == "level" and any(abs(10 * s - round(10 * s)) > 1e-9 for s in slips):
            raise ValueError(f"synthetic_tools: slip_in_prompt=level states slips in tenths; got {list(slips)}")
        super().__init__(seed, tool_latency_ms, tool_latency_sigma)
        self.width = width
        self.tools = WALK_TOOLS
        self._tasks = []
        for slip in slips:
            for start in range(width):
                for goal in range(width):
                    if min_distance <= abs(goal - start) <= max_distance:
                        words = f"start {start} goal {goal}" + self._ice_words(slip, slip_in_prompt)
                        self._tasks.append(
                            Task(
                                task_id=f"walk-{start}-{goal}-{slip:g}",
                                messages=[{"role": "system", "content": "walk"}, {"role": "user", "content": words}],
                                tools=self.tools,
                                gold_answer="done",
                                meta={"start": start, "goal": goal, "slip": float(slip), "wall": False},
                            )
                        )
        if walls:
            self._tasks += [
                Task(
                    task_id=f"walk-{t.meta['start']}-{t.meta['goal']}-wall",
                    messages=[
                        t.messages[0],
                        {"role": "user", "content": f"start {t.meta['start']} goal {t.meta['goal']} wall"},
                    ],
                    tools=self.tools,
                    gold_answer="done",
                    meta={**t.meta, "wall": True},
                )
                for t in self._tasks
                if t.meta["slip"] == 0.0 and t.meta["start"] != t.meta["goal"]
            ]

    @staticmethod
    def _ice_words(slip: float, slip_in_prompt: str) -> str:
        if slip <= 0:
            return ""
        return " ice" if slip_in_prompt == "flag" else f" ice {round(10 * slip)}"

    def tasks(self, split: str = "train") -> list[Task]:
        return list(self._tasks)

    def reset(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task, data=self._fresh_randomness({"pos": task.meta["start"]}))

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        self._simulate_latency(state)
        if call.name != "move" or call.arguments.get("dir") not in ("left", "right"):
            return f"Error: expected move(dir=left|right), got {call.name}({json.dumps(call.arguments)})"
        state.history.append(call)
        d = state.data
        target = d["pos"] + (1 if call.arguments["dir"] == "right" else -1)
        if self._blocked(state.task, target):
            return f"at {d['pos']} wall"
        if d["rng"].random() >= state.task.meta["slip"]:
            d["pos"] = target
        return f"at {d['pos']}"

    @staticmethod
    def kind(task: Task) -> str:
        """The task's level as its prompt states it: ``dry``, ``ice<N>`` (slip N/10) or ``wall``."""
        m = task.meta
        return "wall" if m.get("wall", False) else ("dry" if m["slip"] == 0 else f"ice{round(10 * m['slip'])}")

    def _blocked(self, task: Task, cell: int) -> bool:
        """Whether a move into `cell` hits a wall: the line's edges, or a walled-off goal."""
        return not 0 <= cell < self.width or (task.meta.get("wall", False) and cell == task.meta["goal"])

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        return float(final_answer == "done" and state.data["pos"] == state.task.meta["goal"])

    def uniform_action_success(self, task: Task, max_turns: int) -> float:
        """Exact success rate of the policy that picks left / right / answer uniformly each turn.

        Dynamic programme over (turns left, cell): answering ends the episode,
        so P(t, x) = 1/3 [x == goal] + 1/3 Σ_dir E[P(t-1, next cell)].
        """
        goal, slip, w = task.meta["goal"], task.meta["slip"], self.width
        value = [0.0] * w  # no turns left: the episode is truncated, reward 0
        for _ in range(max_turns):
            new = []
            for x in range(w):
                v = float(x == goal) / 3.0
                for step in (-1, 1):
                    y = x + step
                    v += (value[x] if self._blocked(task, y) else slip * value[x] + (1 - slip) * value[y]) / 3.0
                new.append(v)
            value = new
        return value[task.meta["start"]]
