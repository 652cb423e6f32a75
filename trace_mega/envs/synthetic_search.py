"""`synthetic_search`: multi-hop lookups in a hidden fact store, with ground-truth turn labels.

The TRACE-C test bed (docs/credit.md, "Credit accuracy"): a task asks for the
value behind a key; the answer is reachable only by following the store's
facts. Each task has its own hidden store over the keys `a … j`:

* the **gold chain** `k_0 → k_1 → … → k_{h−1}` (h ∈ `hops`, 1–3): every key but
  the last holds a pointer (``k_0 is same as k_1``), the last holds the value
  (``k_2 is 7``), a digit — the gold answer;
* every other key is **irrelevant**: a value (never the gold digit, so the gold
  answer appears in an observation only after the right hops) or, with
  probability `pointer_prob`, a pointer to another irrelevant key.

The prompt is ``find k_0``; the one tool is ``lookup(key)`` (observation: the
key's fact). The answer is ``<answer> 7 </answer>`` (three tokens); reward 1
iff it equals the gold digit.

Every turn is labelled — ``useful`` when one of its executed lookups revealed a
fact of the gold chain for the first time on its path, else not useful (other
keys, repeats, malformed turns, answers). Labels are computed from the tree
(`turn_labels`) with the chain kept in the task metadata: ground truth for
credit accuracy (`trace_mega.credit.metrics`), never rendered into the
policy's context.

The tiny word-level tokenizer of `trace_mega.envs.tokenizer` is used (one added
token per complete lookup call; ``<answer>`` / ``</answer>`` added tokens
around a plain digit word), and the ordinary ReAct rendering and parsing path.
The digit is a plain word, the same token as in the observations, so "copy the
revealed value" is a one-token copy, and the TRACE-C probe scores it after the
answer template ``<answer>`` (`ANSWER_TEMPLATE`).
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any, Optional, Sequence

from trace_mega.envs.base import ENVS, Env, EpisodeState, Task, ToolCall
from trace_mega.envs.latency import ToolLatency
from trace_mega.envs.synthetic import call_token
from trace_mega.envs.tokenizer import build_tiny_tokenizer
from trace_mega.rollout.react import ReactScaffold

if TYPE_CHECKING:
    from trace_mega.rollout.tree import RolloutTree

KEYS = list("abcdefghij")
DIGITS = [str(d) for d in range(10)]
WORDS = ["search", "lookup", "find", "is", "same", "as", *KEYS, *DIGITS]
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
ANSWER_TEMPLATE = ANSWER_OPEN + " "
"""`credit.answer_template` for this env: the probe scores the gold digit after `<answer>`."""


def lookup_token(key: str) -> str:
    """The one-token lookup call string of `key`."""
    return call_token("lookup", {"key": key})


ACTION_TOKENS = [lookup_token(k) for k in KEYS] + [ANSWER_OPEN, ANSWER_CLOSE]


def answer_text(value: str) -> str:
    """The final-answer text of `value` (three tokens)."""
    return f"{ANSWER_OPEN} {value} {ANSWER_CLOSE}"


def search_tokenizer():
    """The tiny tokenizer of `synthetic_search` (≈45 tokens)."""
    return build_tiny_tokenizer(WORDS, ACTION_TOKENS)


def fact_text(key: str, fact: dict[str, str]) -> str:
    """``k is 7`` or ``k is same as j``."""
    return f"{key} is {fact['value']}" if "value" in fact else f"{key} is same as {fact['pointer']}"


def useful_lookups(chain: Sequence[str], lookups: Sequence[Sequence[str]]) -> list[bool]:
    """Per turn (its looked-up keys, in order), True when it revealed a gold-chain fact for the first time."""
    seen: set[str] = set()
    out = []
    for keys in lookups:
        new = {k for k in keys if k in chain and k not in seen}
        seen.update(keys)
        out.append(bool(new))
    return out


def make_store(rng: random.Random, hops: Sequence[int], pointer_prob: float) -> dict[str, Any]:
    """One hidden store: {'chain': [...], 'facts': {key: {'value'|'pointer': str}}, 'gold': digit}."""
    h = rng.choice(list(hops))
    keys = list(KEYS)
    rng.shuffle(keys)
    chain, rest = keys[:h], keys[h:]
    gold = rng.choice(DIGITS)
    facts: dict[str, dict[str, str]] = {}
    for i, k in enumerate(chain):
        facts[k] = {"pointer": chain[i + 1]} if i + 1 < h else {"value": gold}
    others = [d for d in DIGITS if d != gold]
    for k in rest:
        if len(rest) > 1 and rng.random() < pointer_prob:
            facts[k] = {"pointer": rng.choice([j for j in rest if j != k])}
        else:
            facts[k] = {"value": rng.choice(others)}
    return {"chain": chain, "facts": {k: facts[k] for k in KEYS}, "gold": gold}


@ENVS.register("synthetic_search")
class SyntheticSearchEnv(Env):
    """Follow pointers through a hidden fact store to the gold value; turns labelled useful / not."""

    name = "synthetic_search"

    def __init__(
        self,
        num_tasks: int = 256,
        num_test_tasks: int = 64,
        hops: Sequence[int] = (1, 2, 3),
        pointer_prob: float = 0.3,
        seed: int = 0,
        tool_latency_ms: float = 0.0,
        tool_latency_sigma: float = 0.0,
    ) -> None:
        if num_tasks < 1 or num_test_tasks < 0:
            raise ValueError(
                f"synthetic_search: need num_tasks >= 1 and num_test_tasks >= 0 (got {num_tasks}, {num_test_tasks})"
            )
        if not hops or any(not 1 <= int(h) <= len(KEYS) - 1 for h in hops):
            raise ValueError(f"synthetic_search: hops must be non-empty and in 1..{len(KEYS) - 1}, got {list(hops)}")
        if not 0.0 <= pointer_prob <= 1.0:
            raise ValueError(f"synthetic_search: pointer_prob must be in [0, 1], got {pointer_prob}")
        self.hops = [int(h) for h in hops]
        self.pointer_prob = float(pointer_prob)
        self.latency = ToolLatency(tool_latency_ms, tool_latency_sigma)
        self._seed = seed
        self.tokenizer = search_tokenizer()
        self.tools = [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "the fact stored under a key",
                    "parameters": {
                        "type": "object",
                        "properties": {"key": {"type": "string", "enum": KEYS}},
                        "required": ["key"],
                        "additionalProperties": False,
                    },
                },
            }
        ]
        # Train and test stores come from disjoint seed streams.
        self._splits = {
            "train": self._make_tasks("train", num_tasks, random.Random(f"search-train-{seed}")),
            "test": self._make_tasks("test", num_test_tasks, random.Random(f"search-test-{seed}")),
        }

    def _make_tasks(self, split: str, n: int, rng: random.Random) -> list[Task]:
        return [
            self.task_from_store(f"search-{split}-{i}", make_store(rng, self.hops, self.pointer_prob)) for i in range(n)
        ]

    def task_from_store(self, task_id: str, store: dict[str, Any]) -> Task:
        """The task asking for the value behind `store['chain'][0]`."""
        return Task(
            task_id=task_id,
            messages=[
                {"role": "system", "content": "search"},
                {"role": "user", "content": f"find {store['chain'][0]}"},
            ],
            tools=self.tools,
            gold_answer=store["gold"],
            meta={"chain": list(store["chain"]), "facts": store["facts"], "hops": len(store["chain"])},
        )

    @functools.cached_property
    def stop_token_ids(self) -> list[int]:
        """Engine stop ids: the lookup tokens, `</answer>` and the end-of-turn token."""
        return ReactScaffold(self.tokenizer).stop_token_ids

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self._splits:
            raise ValueError(f"synthetic_search: unknown split {split!r}; valid: {', '.join(self._splits)}")
        return list(self._splits[split])

    def reset(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task)

    def fork(self, state: EpisodeState) -> EpisodeState:
        # The store is the task's (read-only); the state is the call history only.
        return EpisodeState(task=state.task, data=dict(state.data), history=list(state.history))

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        # The state has no random stream: the delay is keyed by the path (task, calls so far, this call).
        self.latency.wait(
            (self._seed, state.task.task_id, [(c.name, c.arguments) for c in state.history], call.arguments)
        )
        key = call.arguments.get("key")
        if call.name != "lookup" or key not in state.task.meta["facts"]:
            return f"Error: expected lookup(key) with key one of {' '.join(KEYS)}"
        state.history.append(call)
        return fact_text(key, state.task.meta["facts"][key])

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        return float(final_answer is not None and final_answer.strip() == state.task.gold_answer)

    def turn_labels(self, tree: "RolloutTree") -> list[Optional[bool]]:
        """Per local node of `tree`: None for the root, else whether the turn was useful (module docstring).

        A turn's lookups are the calls the agent loop executed (`Node.info["tool_calls"]`);
        a turn cut by a limit before its call ran, an error turn and an answer reveal nothing.
        """
        chain = tree.meta.get("chain")
        if chain is None:
            raise ValueError(f"tree {tree.prompt_id!r} has no 'chain' in its meta: not a synthetic_search tree")
        labels: list[Optional[bool]] = [None] * len(tree)
        seen: list[set[str]] = [set() for _ in range(len(tree))]
        for i in range(1, len(tree)):  # parents precede children
            node = tree.nodes[i]
            keys = [c["arguments"].get("key") for c in node.info.get("tool_calls", []) if c.get("name") == "lookup"]
            before = seen[node.parent]
            labels[i] = any(k in chain and k not in before for k in keys)
            seen[i] = before | set(keys)
        return labels
