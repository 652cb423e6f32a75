"""`synthetic_levels`: a procedurally generated walk task set with headroom and a held-out split.

The `synthetic_tools` walk (trace_mega/envs/synthetic.py: move left / right on a
line of `width` cells, answer ``<answer>done</answer>`` on the goal; on ``ice N``
each move slips, leaving the agent where it was, with probability N/10) over
every (start, goal, level) with the goal 1..`max_distance` cells away and the
level in `levels`: 900 prompts with the defaults. Every prompt states its level,
``start 2 goal 7 ice 4`` (``ice 0`` on dry tasks), never a success probability;
the distance is read from the two cells. Difficulty spreads the way a real
prompt set's does: a near dry goal is solved by a half-competent policy, a far
``ice 8`` goal almost never within the turn budget, and a greedy policy (always
towards the goal) solves far more of the middle than the warm start does
(docs/envs.md "synthetic_levels").

**Splits.** A task belongs to ``test`` when a seeded hash of its parameters,
sha256 of ``(split_seed, start, goal, level)`` read as a number in [0, 1), is
below `test_fraction`, else to ``train``. Each parameter tuple is one task and
lands in exactly one split, so the splits are disjoint by construction; the
assignment depends on `split_seed` alone, not on the episode RNG's `seed` (the
warm start's transcripts run with another `seed` and must see the same train
split). The trainer draws ``train`` prompts only; periodic evaluation reads
`eval.split` (``test``).

Eval groups: `meta["benchmark"]` is the level (``ice4``), so the eval report
has a row per level (trace_mega/evaluation.py).
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

from trace_mega.envs.base import ENVS, Task
from trace_mega.envs.synthetic import WALK_TOOLS, SyntheticToolsEnv, _SeededEnv

SPLITS = ("train", "test")


def split_of(split_seed: int, start: int, goal: int, level: int, test_fraction: float) -> str:
    """``test`` or ``train``: a seeded hash of the task's parameters against `test_fraction`."""
    digest = hashlib.sha256(repr((split_seed, start, goal, level)).encode()).digest()
    return "test" if int.from_bytes(digest[:8], "little") / 2.0**64 < test_fraction else "train"


def prompt_text(start: int, goal: int, level: int) -> str:
    """The user turn: the two cells and the ice level, every word a token of the tiny tokenizer."""
    return f"start {start} goal {goal} ice {level}"


@ENVS.register("synthetic_levels")
class SyntheticLevelsEnv(SyntheticToolsEnv):
    """The walk over every (start, goal, ice level), split into disjoint train / test prompts by a hash."""

    name = "synthetic_levels"

    def __init__(
        self,
        width: int = 10,
        max_distance: int = 9,
        levels: Sequence[int] = tuple(range(10)),
        test_fraction: float = 0.3,
        split_seed: int = 0,
        seed: int = 0,
        tool_latency_ms: float = 0.0,
        tool_latency_sigma: float = 0.0,
    ) -> None:
        """`width`: cells 0 .. width-1; goals 1 .. `max_distance` cells from the start; `levels`: the ice levels
        N (a move slips with probability N/10), each one copy of the (start, goal) pairs; `test_fraction`:
        expected share of the tasks in the test split, drawn by the hash of `split_seed` and the task's
        parameters; `seed`: episode randomness (slips); `tool_latency_ms` / `tool_latency_sigma`:
        simulated tool latency (median ms, lognormal sigma)."""
        if not 2 <= width <= 10 or not 1 <= max_distance < width:
            raise ValueError(
                f"synthetic_levels: need 2 <= width <= 10 and 1 <= max_distance < width (got {width}, {max_distance})"
            )
        if (
            not levels
            or any(not (isinstance(n, int) and 0 <= n <= 9) for n in levels)
            or len(set(levels)) != len(levels)
        ):
            raise ValueError(f"synthetic_levels: levels must be distinct integers in 0..9, got {list(levels)}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"synthetic_levels: test_fraction must be in (0, 1), got {test_fraction}")
        _SeededEnv.__init__(self, seed, tool_latency_ms, tool_latency_sigma)
        self.width = width
        self.tools = WALK_TOOLS
        self._splits: dict[str, list[Task]] = {s: [] for s in SPLITS}
        for level in levels:
            for start in range(width):
                for goal in range(width):
                    if 1 <= abs(goal - start) <= max_distance:
                        split = split_of(split_seed, start, goal, level, test_fraction)
                        self._splits[split].append(
                            Task(
                                task_id=f"levels-{start}-{goal}-{level}",
                                messages=[
                                    {"role": "system", "content": "walk"},
                                    {"role": "user", "content": prompt_text(start, goal, level)},
                                ],
                                tools=self.tools,
                                gold_answer="done",
                                meta={
                                    "start": start,
                                    "goal": goal,
                                    "slip": level / 10,
                                    "wall": False,
                                    "split": split,
                                    "benchmark": f"ice{level}",
                                },
                            )
                        )

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self._splits:
            raise ValueError(f"synthetic_levels: unknown split {split!r}; valid: {', '.join(SPLITS)}")
        return list(self._splits[split])

    def walker_success(self, task: Task, max_turns: int, correct_action_prob: float, answer_prob: float) -> float:
        """Exact success rate of the warm start's transcript walker (`WalkTranscriptEngine` in
        trace_mega/commands/pretrain.py): each turn but the last (which answers) it takes the right action
        with probability c = `correct_action_prob` (answer on the goal, else a move towards it), else on the
        goal a random move, off it an answer with probability a = `answer_prob` or a move away.

        Dynamic programme over (turns left t, cell x), V_1(x) = [x == goal]:
        V_t(goal) = c + (1 - c) / 2 · Σ_dir M_t(dir), V_t(x) = c · M_t(towards) + (1 - c)(1 - a) · M_t(away),
        with M_t(dir) = slip · V_{t-1}(x) + (1 - slip) · V_{t-1}(x + dir) (V_{t-1}(x) into an edge).
        """
        goal, slip, c, a = task.meta["goal"], task.meta["slip"], correct_action_prob, answer_prob
        value = [float(x == goal) for x in range(self.width)]  # the last turn answers
        for _ in range(max_turns - 1):
            move = [  # move[x][dir]: M(dir) from cell x, dir 0 = left, 1 = right
                [
                    value[x] if self._blocked(task, y) else slip * value[x] + (1 - slip) * value[y]
                    for y in (x - 1, x + 1)
                ]
                for x in range(self.width)
            ]
            value = [
                c + (1 - c) / 2 * sum(move[x])
                if x == goal
                else c * move[x][goal > x] + (1 - c) * (1 - a) * move[x][goal < x]
                for x in range(self.width)
            ]
        return value[task.meta["start"]]

    @staticmethod
    def greedy_success(task: Task, max_turns: int) -> float:
        """Exact success rate of the greedy policy (always towards the goal, answer on it): the ceiling a
        policy can reach. It needs d = |goal - start| moves that do not slip among its first max_turns - 1
        turns, the last turn answering: P(Binomial(max_turns - 1, 1 - slip) >= d)."""
        d, slip, n = abs(task.meta["goal"] - task.meta["start"]), task.meta["slip"], max_turns - 1
        return sum(math.comb(n, k) * (1 - slip) ** k * slip ** (n - k) for k in range(d, n + 1))
