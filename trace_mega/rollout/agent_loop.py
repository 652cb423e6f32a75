"""The ReAct agent loop: engine + environment -> rollout trees.

`AgentLoop.rollout` runs bare rollouts for a batch of tasks and
`AgentLoop.expand` branches continuations from chosen tree nodes. Both drive
all live episodes in lock step, one `engine.generate` call per turn-wave:

    prefixes of live episodes -> engine.generate (stops at the end of a tool
    call / turn) -> parse -> tool calls on a thread pool with a timeout ->
    observation tokens appended -> next wave

A turn may make at most `max_tool_calls_per_turn` calls (more: an error
observation, none run), and its calls run in order on one fork of the state
within ONE time budget, `tool_timeout_s`, shared by all of them: when it runs
out, the turn's calls are reported as timed out and have no effect, and the
abandoned worker starts no further call of that turn.

Token layout of a turn node: the generated ids (loss_mask 1, the engine's
behaviour log-probs) followed by the observation ids (loss_mask 0) rendered
by the chat template (`ReactScaffold.observation_ids`). Generated ids are
never decoded and re-encoded, so the concatenation of node tokens along a
path is exactly the stream the engine continued from.

Episode ends (the last node becomes a leaf with a reward):
* a final answer: ``env.reward(state, answer)``;
* the turn limit (`max_turns`, counted from the root; the final answer turn
  counts) or the token limit (`max_total_tokens`, prompt included):
  ``env.reward(state, None)``; the tool call of a turn cut by a limit is not
  executed, and an observation that would cross the token limit is dropped.
A turn cut at `max_new_tokens_per_turn`, malformed output, a failing or hanging
tool, a state that `env.fork` cannot copy all become error observations and
the episode goes on. In a multi-turn
task (`Env.next_turn` overridden) a final answer ends the current user turn:
the next user message(s) are appended to the answer node (kind ``final``,
loss 0 on them) and the episode goes on; the reward comes when `next_turn`
returns None. Tool calls are validated against ``state.data["tools"]`` when the
env keeps one (tools revealed mid-episode), else ``task.tools``.

Branching needs the environment state after every turn: the loop keeps one
`EpisodeState` per non-terminal node in ``tree.runtime["states"]`` (tools run on
a fresh `env.fork` of it, so a stored state is never mutated). Trees loaded
from JSONL have no states and cannot be expanded; `release` drops them.

Seeds (docs/design.md §3.4; results must not depend on how many replicas
roll out, nor on which episodes share an engine call): every episode has its
own seed, derived from the call's seed, its tree's key (the caller's prompt
index, `keys`) and its origin — bare rollout j, or continuation c branched
at node n. The engine request of each turn is seeded from (episode seed,
turn), and the environment is reseeded (`Env.reseed`) from (episode seed,
what, turn) right before every `env.reset` / `env.fork`, so an environment
that draws its episode randomness from one master RNG at reset/fork time
(the synthetic ones) gives an episode the same randomness whatever ran
before it on this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

from trace_mega.config import RolloutConfig
from trace_mega.envs.base import Env, EpisodeState, ParsedTurn, Task, ToolCall
from trace_mega.rollout.engines.base import Completion, Engine, SamplingParams
from trace_mega.rollout.react import ReactScaffold, error_observation
from trace_mega.rollout.tree import Node, RolloutTree


@dataclass
class RolloutStats:
    """Counters of one `rollout` / `expand` call (also accumulated in `AgentLoop.stats`)."""

    episodes: int = 0
    engine_calls: int = 0
    turns: int = 0
    generated_tokens: int = 0
    prefix_tokens: int = 0
    """Prefix tokens sent to the engine, summed over requests (what prefill would cost without a cache)."""
    cached_prefix_tokens: int = 0
    tool_calls: int = 0
    tool_timeouts: int = 0
    parse_errors: int = 0
    length_cut_turns: int = 0
    """Turns that hit max_new_tokens_per_turn."""
    truncated_episodes: int = 0
    """Episodes ended by max_turns / max_total_tokens."""
    final_answers: int = 0
    successes: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0

    def add(self, other: "RolloutStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class _Episode:
    tree_idx: int
    tip: int
    """Tree node the next turn attaches under."""
    owns_tip: bool
    """True when this episode created `tip` (it may then become the episode's leaf)."""
    prefix: list[int]
    state: EpisodeState
    turns: int
    seed: int
    """The episode's own seed (`derive_seed` of its origin): its engine requests and env draws derive from it."""


def derive_seed(*parts: Any) -> int:
    """A 62-bit seed that depends only on `parts` (ints and strings): stable across processes,
    Python versions and hash randomisation (unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class _ToolJob:
    """The tool calls of one turn, run in order on a fork of the episode state (in a pool thread).

    The results are written only by the main thread (from the future's return
    value, or as timeout errors), so a hung thread that finishes late cannot
    touch them.
    """

    step: Callable[[EpisodeState, ToolCall], str]
    fork: EpisodeState
    calls: list[ToolCall]
    state: Optional[EpisodeState] = None
    """The state after the calls; None when they timed out (the fork must not be used then)."""
    observations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def run(self, deadline: float) -> tuple[list[str], float]:
        """The calls' observations and seconds; `deadline` (time.monotonic) ends the turn's shared budget."""
        t0 = time.perf_counter()
        out = []
        for call in self.calls:
            if time.monotonic() >= deadline:  # the loop has already given up on this turn: start nothing more
                break
            try:
                out.append(str(self.step(self.fork, call)))
            except Exception as exc:  # an env must not raise, but a tool bug must not kill the rollout
                out.append(error_observation(f"tool {call.name!r} failed: {type(exc).__name__}: {exc}"))
        return out, time.perf_counter() - t0


@dataclass
class _PendingTurn:
    """A recorded turn whose episode goes on: what follows it is appended once its tools ran."""

    ep: _Episode
    gen: list[int]
    """Generated token ids (loss 1)."""
    logprobs: list[float]
    """Behaviour log-probs of `gen`."""
    parsed: ParsedTurn
    info: dict[str, Any]
    """The node's `info` (finish reason, counts, ...)."""
    job: Optional[_ToolJob] = None
    """The turn's tool calls; None after a parse error or a final answer."""
    user: Optional[list[dict[str, Any]]] = None
    """Multi-turn tasks: the next user message(s) that follow a final answer."""


class AgentLoop:
    """Drive `engine` and `env` to build rollout trees (see the module docstring)."""

    def __init__(
        self,
        env: Env,
        engine: Engine,
        tokenizer: Any,
        rollout_cfg: RolloutConfig,
        *,
        tool_timeout_s: float = 10.0,
        tool_workers: int = 8,
        max_tool_calls_per_turn: int = 8,
    ) -> None:
        if tool_timeout_s <= 0 or tool_workers < 1 or max_tool_calls_per_turn < 1:
            raise ValueError(
                "need tool_timeout_s > 0, tool_workers >= 1 and max_tool_calls_per_turn >= 1, got "
                f"{tool_timeout_s}, {tool_workers}, {max_tool_calls_per_turn}"
            )
        self.env, self.engine, self.cfg = env, engine, rollout_cfg
        self.scaffold = ReactScaffold(tokenizer)
        # Multi-turn tasks (Env.next_turn overridden): an answer may be followed by a new user turn.
        self._multi_turn = type(env).next_turn is not Env.next_turn
        self.tool_timeout_s = float(tool_timeout_s)
        self.tool_workers = int(tool_workers)
        self.max_tool_calls_per_turn = int(max_tool_calls_per_turn)
        self._pool = cf.ThreadPoolExecutor(self.tool_workers, thread_name_prefix="tool")
        self.stats = RolloutStats()
        self.last_stats = RolloutStats()

    # --- public API ---------------------------------------------------------------
    def rollout(
        self, tasks: list[Task], counts: list[int], seed: int = 0, keys: Optional[Sequence[Hashable]] = None
    ) -> list[RolloutTree]:
        """`counts[i]` bare rollouts of `tasks[i]`; one tree per task, in order (count 0: root only).

        `keys[i]` identifies tree i for seeding (default: i); a caller that rolls out one step's
        prompts in pieces (replicas) passes each prompt's index in the whole step, so rollout j of a
        prompt is the same episode whichever piece it is in. The key is kept in `tree.runtime`.
        """
        keys = list(range(len(tasks))) if keys is None else list(keys)
        if len(tasks) != len(counts) or len(keys) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks but {len(counts)} counts and {len(keys)} keys")
        if any(int(c) != c or c < 0 for c in counts):
            raise ValueError(f"counts must be non-negative integers, got {counts}")
        trees, episodes = [], []
        for ti, (task, count) in enumerate(zip(tasks, counts)):
            prompt = self.scaffold.prompt_ids(task)
            tree = RolloutTree(
                task.task_id,
                prompt,
                prompt_text=self.scaffold.decode(prompt),
                gold_answer=task.gold_answer,
                meta={"env": self.env.name, **_json_safe(task.meta)},
            )
            self.env.reseed(derive_seed(seed, keys[ti], "reset"))
            root_state = self.env.reset(task)
            tree.runtime = {"states": {0: root_state}, "key": keys[ti]}
            trees.append(tree)
            for j in range(int(count)):
                ep_seed = derive_seed(seed, keys[ti], "rollout", j)
                self.env.reseed(derive_seed(ep_seed, "fork"))
                episodes.append(_Episode(ti, 0, False, list(prompt), self.env.fork(root_state), 0, ep_seed))
        self._run(trees, episodes)
        return trees

    def expand(self, trees: list[RolloutTree], branch_points: list[tuple[int, int, int]], seed: int = 0) -> None:
        """Add `k` continuations below node `node_id` of `trees[tree_idx]` for each (tree_idx, node_id, k).

        The environment state at the node is restored from the one kept during
        the rollout. Terminal nodes (leaves with a reward) cannot be branched.
        """
        episodes, branched = [], {}
        for tree_idx, node_id, k in branch_points:
            if not 0 <= tree_idx < len(trees):
                raise IndexError(f"branch point tree index {tree_idx} not in a batch of {len(trees)} trees")
            tree = trees[tree_idx]
            if not 0 <= node_id < len(tree):
                raise IndexError(f"node {node_id} not in tree {tree.prompt_id!r} of {len(tree)} nodes")
            if tree.nodes[node_id].reward is not None:
                raise ValueError(f"node {node_id} of tree {tree.prompt_id!r} is terminal; it cannot be branched")
            if int(k) != k or k < 0:
                raise ValueError(f"continuation count must be a non-negative integer, got {k}")
            states = getattr(tree, "runtime", {}).get("states", {})
            if node_id not in states:
                raise ValueError(
                    f"tree {tree.prompt_id!r} keeps no environment state at node {node_id} "
                    "(loaded from JSONL, or released); it cannot be expanded"
                )
            prefix = tree.prefix_token_ids(node_id)
            depth = tree.depth(node_id)
            key = tree.runtime.get("key", tree_idx)
            first = branched.get((tree_idx, node_id), 0)  # a node listed twice: its later continuations go on counting
            branched[(tree_idx, node_id)] = first + int(k)
            for c in range(first, first + int(k)):
                ep_seed = derive_seed(seed, key, "branch", node_id, c)
                # A state fork cannot copy is shared instead: an episode's state is never changed in place
                # (tools run on forks), and the continuation's tool turns report the failure.
                fork, _why = self._fork(states[node_id], derive_seed(ep_seed, "fork"))
                episodes.append(
                    _Episode(
                        tree_idx,
                        node_id,
                        False,
                        list(prefix),
                        states[node_id] if fork is None else fork,
                        depth,
                        ep_seed,
                    )
                )
        self._run(trees, episodes)

    def _fork(self, state: EpisodeState, seed: int) -> tuple[Optional[EpisodeState], str]:
        """(`env.fork(state)` after `env.reseed(seed)`, "") or (None, why): a state the model made too
        deep or too large to copy (RecursionError in a deepcopy) costs its own episode a turn, never
        the rollout."""
        try:
            self.env.reseed(seed)
            return self.env.fork(state), ""
        except Exception as exc:  # noqa: BLE001
            return None, f"the environment state could not be copied ({type(exc).__name__}: {str(exc)[:200]})"

    @staticmethod
    def release(trees: list[RolloutTree]) -> None:
        """Drop the kept environment states (the trees can no longer be expanded)."""
        for tree in trees:
            getattr(tree, "runtime", {}).pop("states", None)

    def close(self) -> None:
        """Stop the tool pool (threads of hung tools are left to finish on their own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "AgentLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the wave loop ----------------------------------------------------------
    def _run(self, trees: list[RolloutTree], live: list[_Episode]) -> None:
        stats = RolloutStats(episodes=len(live))
        cfg = self.cfg
        while live:
            ready = []
            for ep in live:
                if len(ep.prefix) >= cfg.max_total_tokens:
                    self._finish_truncated(trees[ep.tree_idx], ep, "max_total_tokens", stats)
                else:
                    ready.append(ep)
            if not ready:
                break
            sampling = SamplingParams(
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens_per_turn,
                stop_token_ids=list(self.scaffold.stop_token_ids),
                seeds=[derive_seed(ep.seed, "generate", ep.turns) for ep in ready],
            )
            t0 = time.perf_counter()
            completions = self.engine.generate([ep.prefix for ep in ready], sampling)
            stats.generate_s += time.perf_counter() - t0
            stats.engine_calls += 1
            if len(completions) != len(ready):
                raise RuntimeError(f"engine returned {len(completions)} completions for {len(ready)} prefixes")
            live, jobs = [], []
            for ep, comp in zip(ready, completions):
                turn = self._turn(trees[ep.tree_idx], ep, comp, stats)
                if turn is not None:
                    jobs.append(turn)
            self._run_tools(jobs, stats)
            for turn in jobs:
                if self._attach_observation(trees[turn.ep.tree_idx], turn, stats):
                    live.append(turn.ep)
        self.last_stats = stats
        self.stats.add(stats)

    def _turn(self, tree: RolloutTree, ep: _Episode, comp: Completion, stats: RolloutStats) -> Optional[_PendingTurn]:
        """Record one generated turn; returns the pending tool/observation work, or None when the episode ended."""
        remaining = self.cfg.max_total_tokens - len(ep.prefix)
        cap = min(self.cfg.max_new_tokens_per_turn, remaining)
        if len(comp.token_ids) != len(comp.logprobs):
            raise RuntimeError(f"engine completion has {len(comp.token_ids)} tokens but {len(comp.logprobs)} log-probs")
        gen, lp = [int(t) for t in comp.token_ids[:cap]], [float(x) for x in comp.logprobs[:cap]]
        cut = comp.finish_reason == "length" or len(comp.token_ids) > cap
        stats.turns += 1
        stats.generated_tokens += len(gen)
        stats.prefix_tokens += len(ep.prefix)
        stats.cached_prefix_tokens += comp.cached_prefix_tokens
        stats.length_cut_turns += int(cut)
        tree.meta["generated_tokens"] = tree.meta.get("generated_tokens", 0) + len(gen)
        # Tools offered now: an env may extend them mid-episode (BFCL miss_func reveals functions).
        tools = ep.state.data.get("tools", ep.state.task.tools)
        parsed = self.scaffold.parse(gen, tools, truncated=cut, max_tool_calls=self.max_tool_calls_per_turn)
        info = {
            "finish_reason": "length" if cut else comp.finish_reason,
            "num_generated": len(gen),
            "cached_prefix_tokens": comp.cached_prefix_tokens,
        }
        ep.turns += 1
        if parsed.final_answer is not None:
            stats.final_answers += 1
            after, messages = ep.state, None
            if self._multi_turn:  # the answer ends a user turn; the task may go on (on a fork: kept states stay)
                after, why = self._fork(ep.state, derive_seed(ep.seed, "next_turn", ep.turns))
                if after is None:  # the task ends here, the answer judged on the state as it is
                    after, info["error"] = ep.state, why
                else:
                    messages = self.env.next_turn(after, parsed.final_answer)
            if messages is None:
                reward = float(self.env.reward(after, parsed.final_answer))
                stats.successes += int(reward > 0.5)
                self._add(tree, ep, _node(gen, lp, [], "final", parsed, info, reward=reward))
                return None
            ep.state = after
            info["next_turn"] = True
            if ep.turns >= self.cfg.max_turns:
                info["truncated"] = "max_turns"
                self._end(tree, ep, _node(gen, lp, [], "final", parsed, info), stats)
                return None
            return _PendingTurn(ep, gen, lp, parsed, info, user=list(messages))
        if parsed.error is not None:
            stats.parse_errors += 1
            info["error"] = parsed.error
        if ep.turns >= self.cfg.max_turns:  # the limit ends the episode before the call runs
            info["truncated"] = "max_turns"
            self._end(tree, ep, _node(gen, lp, [], "error" if parsed.error else "tool", parsed, info), stats)
            return None
        job = None
        if parsed.error is None:
            fork, why = self._fork(ep.state, derive_seed(ep.seed, "tools", ep.turns))
            if fork is None:
                parsed.error, parsed.tool_calls = f"{why}; the tool calls were not run", []
                info["error"] = parsed.error
            else:
                job = _ToolJob(self.env.step, fork, parsed.tool_calls)
        return _PendingTurn(ep, gen, lp, parsed, info, job=job)

    def _run_tools(self, turns: list[_PendingTurn], stats: RolloutStats) -> None:
        """Run the wave's tool jobs on the pool, `tool_workers` at a time; a turn's calls share one timeout."""
        pending = [t.job for t in turns if t.job is not None]
        for at in range(0, len(pending), self.tool_workers):
            chunk = pending[at : at + self.tool_workers]
            limit = self.tool_timeout_s
            deadline = time.monotonic() + limit
            futures = {self._pool.submit(job.run, deadline): job for job in chunk}
            done, not_done = cf.wait(futures, timeout=limit)
            for fut in done:
                job = futures[fut]
                job.observations, job.seconds = fut.result()
                job.state = job.fork
                stats.tool_s += job.seconds
            for fut in not_done:
                job = futures[fut]
                job.observations = [
                    error_observation(
                        f"tool call {c.name!r} timed out after {self.tool_timeout_s:g} s (shared by this turn's tool "
                        "calls); this turn's tool calls had no effect"
                    )
                    for c in job.calls
                ]
                job.seconds = limit
                stats.tool_timeouts += 1
            if not_done:  # hung workers stay busy: later chunks get a fresh pool
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = cf.ThreadPoolExecutor(self.tool_workers, thread_name_prefix="tool")
            stats.tool_calls += sum(len(j.calls) for j in chunk)

    def _attach_observation(self, tree: RolloutTree, turn: _PendingTurn, stats: RolloutStats) -> bool:
        """Append what follows a turn (tool results, an error, or the next user turn); True when the episode goes on."""
        ep, gen, lp, parsed, info, job, user = (
            turn.ep,
            turn.gen,
            turn.logprobs,
            turn.parsed,
            turn.info,
            turn.job,
            turn.user,
        )
        if user is not None:
            observations = [str(m.get("content", "")) for m in user]
        elif job is None:
            observations = [error_observation(parsed.error)]
        else:
            observations = job.observations
            info["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in job.calls]
            info["tool_s"] = job.seconds
            if job.state is None:
                info["tool_timeout"] = True
            else:
                ep.state = job.state
        if user is not None:
            obs, kind = self.scaffold.user_turn_ids(gen, user), "final"
        else:
            obs, kind = self.scaffold.observation_ids(gen, observations), "error" if parsed.error else "tool"
        if len(ep.prefix) + len(gen) + len(obs) > self.cfg.max_total_tokens:
            info["truncated"] = "max_total_tokens"
            info["observation_dropped"] = True
            self._end(tree, ep, _node(gen, lp, [], kind, parsed, info, "\n".join(observations)), stats)
            return False
        self._add(tree, ep, _node(gen, lp, obs, kind, parsed, info, "\n".join(observations)))
        tree.runtime["states"][ep.tip] = ep.state
        ep.prefix += gen + obs
        return True

    # --- tree bookkeeping -------------------------------------------------------
    @staticmethod
    def _add(tree: RolloutTree, ep: _Episode, node: Node) -> None:
        ep.tip, ep.owns_tip = tree.add_node(ep.tip, node), True

    def _end(self, tree: RolloutTree, ep: _Episode, node: Node, stats: RolloutStats) -> None:
        """Add `node` as a truncated episode's leaf (reward for 'no answer')."""
        node.reward = float(self.env.reward(ep.state, None))
        stats.truncated_episodes += 1
        stats.successes += int(node.reward > 0.5)
        self._add(tree, ep, node)

    def _finish_truncated(self, tree: RolloutTree, ep: _Episode, reason: str, stats: RolloutStats) -> None:
        """End an episode whose prefix already fills the token budget before its next turn."""
        if ep.owns_tip:  # its last turn node becomes the leaf
            node = tree.nodes[ep.tip]
            node.reward = float(self.env.reward(ep.state, None))
            node.info["truncated"] = reason
            tree.runtime["states"].pop(ep.tip, None)
            stats.truncated_episodes += 1
            stats.successes += int(node.reward > 0.5)
        else:  # nothing generated yet (prompt or branch prefix too long): an empty leaf keeps the budget honest
            self._end(tree, ep, Node(-1, [], [], [], kind="error", info={"truncated": reason}), stats)


def _node(
    gen, lp, obs, kind, parsed: ParsedTurn, info: dict, observation: str = "", reward: Optional[float] = None
) -> Node:
    """A turn node: generated tokens (loss 1, behaviour log-probs) then observation tokens (loss 0)."""
    if parsed.final_answer is not None:
        action = parsed.final_answer
    else:
        action = (
            json.dumps([{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls])
            if parsed.tool_calls
            else ""
        )
    return Node(
        -1,
        gen + obs,
        [1] * len(gen) + [0] * len(obs),
        lp + [0.0] * len(obs),
        kind=kind,
        text=parsed.raw,
        thought=parsed.thought,
        action=action,
        observation=observation,
        reward=reward,
        info=info,
    )


def _json_safe(meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON-serialisable entries of a task's metadata (the tree record must round-trip through JSONL)."""
    out = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[str(k)] = v
    return out
