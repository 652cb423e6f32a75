"""The ReAct agent loop: engine + environment -> rollout trees.

`AgentLoop.rollout` runs bare rollouts for a batch of tasks and
`AgentLoop.expand` branches continuations from chosen tree nodes. Each episode
advances on its own (docs/rollout.md, "Scheduling"):

    episode ready -> engine.submit(its prefix) ... engine.poll() hands back its
    turn (stopped at the end of a tool call / turn) -> parse -> its tool calls
    start on a worker at once -> observation tokens appended -> ready again

There is no barrier between episodes: while one waits for its tools, the
others' turns go on in the engine (continuous batching), and a slow or hung
tool delays only its own episode. The call returns when every episode ended.

A turn may make at most `max_tool_calls_per_turn` calls (more: an error
observation, none run), and its calls run in order on one fork of the state
within ONE time budget, `tool_timeout_s`, shared by all of them
(`trace_mega/rollout/tools.py`): when it runs out, the turn's calls are
reported as timed out and have no effect. At most `max_concurrent_tool_calls`
turns run tools at once (default: all live episodes).

Results do not depend on scheduling: an episode's nodes are kept with it while
it runs and added to its tree when the call ends, in the order (turn, the
episode's place in the call) — the node numbering of a lock-step loop — and
all randomness is seeded from the episode (below), so the trees are the same
whatever the tool latencies, the order in which calls finish, or the limits.

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

Seeds (docs/design.md §6; results must not depend on how many replicas
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

import dataclasses
import hashlib
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Hashable, Optional, Sequence

import torch

from trace_mega.config import RolloutConfig
from trace_mega.envs.base import Env, EpisodeState, ParsedTurn, Task
from trace_mega.rollout.engines.base import Completion, Engine, SamplingParams
from trace_mega.rollout.engines.routing import attach_routes, extend_routes
from trace_mega.rollout.react import ReactScaffold, error_observation, turn_node
from trace_mega.rollout.tools import ToolJob, ToolRunner
from trace_mega.rollout.tree import Node, RolloutTree, json_safe


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
    """Seconds inside the engine (`poll`)."""
    tool_s: float = 0.0
    """Seconds tools ran, summed over turns (concurrent turns each count)."""
    phase_s: float = 0.0
    """Wall seconds of the rollout / expand calls."""
    engine_busy_s: float = 0.0
    """Wall seconds with at least one request in the engine."""
    tool_wait_s: float = 0.0
    """Seconds episodes waited for their tools (from the parsed turn to its observation), summed."""
    tail_s: float = 0.0
    """Seconds from 90% to 100% of a call's episodes finished (summed over calls)."""
    inflight_max: int = 0
    """Most requests in the engine at once (the max over calls when accumulated)."""

    def add(self, other: "RolloutStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, max(self.inflight_max, v) if k == "inflight_max" else getattr(self, k) + v)


@dataclass
class _Episode:
    ordinal: int
    """Place in the call (its engine request id, and the tie-break of the node numbering)."""
    tree_idx: int
    start: int
    """Tree node the episode's first turn attaches under."""
    prefix: list[int]
    state: EpisodeState
    turns: int
    seed: int
    """The episode's own seed (`derive_seed` of its origin): its engine requests and env draws derive from it."""
    nodes: list[tuple[int, Node, Optional[EpisodeState]]] = field(default_factory=list)
    """The episode's turn nodes in order, each with its numbering phase and (non-terminal nodes) the
    state after it; added to the tree when the call ends (`_commit`)."""
    routes: Optional[torch.Tensor] = None
    """With MoE routing capture: (n, L, k) engine routes of the path's first n tokens (`extend_routes`)."""

    @property
    def owns_tip(self) -> bool:
        """Whether the episode has made a node (its last one may then become the episode's leaf)."""
        return bool(self.nodes)


def derive_seed(*parts: Any) -> int:
    """A 62-bit seed that depends only on `parts` (ints and strings): stable across processes,
    Python versions and hash randomisation (unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class _Phase:
    """The running state of one `rollout` / `expand` call."""

    trees: list[RolloutTree]
    stats: RolloutStats
    tools: ToolRunner
    ready: deque
    """Episodes whose next turn can be submitted."""
    inflight: dict[int, _Episode] = field(default_factory=dict)
    """Episodes with a request in the engine, by request id (the episode's ordinal)."""
    finished_at: list[float] = field(default_factory=list)
    """perf_counter() of every episode's end (the phase's tail)."""

    def go_on(self, ep: _Episode, goes_on: bool) -> None:
        if goes_on:
            self.ready.append(ep)
        else:
            self.finished_at.append(time.perf_counter())


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
    job: Optional[ToolJob] = None
    """The turn's tool calls; None after a parse error or a final answer."""
    parsed_at: float = 0.0
    """time.perf_counter() when the turn was parsed (its tool wait starts)."""
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
        max_concurrent_tool_calls: Optional[int] = None,
        max_tool_calls_per_turn: int = 8,
        admission: Optional[Any] = None,
    ) -> None:
        """`admission`: for a replica of several ranks that each run the engine, the object whose
        `agree(ids)` broadcasts the leader's submissions (`replicas.ReplicaAdmission`); None alone."""
        if tool_timeout_s <= 0 or max_tool_calls_per_turn < 1 or (max_concurrent_tool_calls or 1) < 1:
            raise ValueError(
                "need tool_timeout_s > 0, max_concurrent_tool_calls >= 1 (or None) and max_tool_calls_per_turn >= 1, "
                f"got {tool_timeout_s}, {max_concurrent_tool_calls}, {max_tool_calls_per_turn}"
            )
        self.env, self.engine, self.cfg = env, engine, rollout_cfg
        self.scaffold = ReactScaffold(tokenizer)
        # Multi-turn tasks (Env.next_turn overridden): an answer may be followed by a new user turn.
        self._multi_turn = type(env).next_turn is not Env.next_turn
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_concurrent_tool_calls = max_concurrent_tool_calls
        self.max_tool_calls_per_turn = int(max_tool_calls_per_turn)
        self._tools: Optional[ToolRunner] = None
        self.admission = admission
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
                meta={"env": self.env.name, **json_safe(task.meta)},
            )
            self.env.reseed(derive_seed(seed, keys[ti], "reset"))
            root_state = self.env.reset(task)
            tree.runtime = {"states": {0: root_state}, "key": keys[ti]}
            trees.append(tree)
            for j in range(int(count)):
                ep_seed = derive_seed(seed, keys[ti], "rollout", j)
                self.env.reseed(derive_seed(ep_seed, "fork"))
                episodes.append(_Episode(len(episodes), ti, 0, list(prompt), self.env.fork(root_state), 0, ep_seed))
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
                        len(episodes),
                        tree_idx,
                        node_id,
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
        """Stop the tool workers (threads of hung tools are left to finish on their own)."""
        if self._tools is not None:
            self._tools.close()
            self._tools = None

    def __enter__(self) -> "AgentLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the scheduler ---------------------------------------------------------
    def _run(self, trees: list[RolloutTree], episodes: list[_Episode]) -> None:
        """Advance every episode to its end: submit each ready episode's next turn, poll the engine one
        step at a time, start a parsed turn's tools at once, re-submit an episode when its observation
        is attached; wait on tools only when the engine has nothing to do."""
        cfg = self.cfg
        ph = _Phase(trees, RolloutStats(episodes=len(episodes)), self._tool_runner(len(episodes)), deque(episodes))
        base = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens_per_turn,
            stop_token_ids=list(self.scaffold.stop_token_ids),
        )
        t_start = time.perf_counter()
        try:
            while True:
                for ep in [ep for ep in ph.ready if len(ep.prefix) >= cfg.max_total_tokens]:
                    ph.ready.remove(ep)
                    self._finish_truncated(ep, "max_total_tokens", ph.stats)
                    ph.finished_at.append(time.perf_counter())
                admit = self._admissions(ph)
                if admit is None:
                    break
                for ep in admit:
                    seed = derive_seed(ep.seed, "generate", ep.turns)
                    self.engine.submit(ep.ordinal, ep.prefix, dataclasses.replace(base, seed=seed))
                    ph.inflight[ep.ordinal] = ep
                ph.stats.inflight_max = max(ph.stats.inflight_max, len(ph.inflight))
                if ph.inflight:
                    t0 = time.perf_counter()
                    done = self.engine.poll()
                    dt = time.perf_counter() - t0
                    ph.stats.generate_s += dt
                    ph.stats.engine_busy_s += dt
                    ph.stats.engine_calls += 1
                    for rid, comp in done:
                        ep = ph.inflight.pop(rid)
                        turn = self._turn(trees[ep.tree_idx], ep, comp, ph.stats)
                        if turn is None:
                            ph.go_on(ep, False)
                        elif turn.job is None:
                            ph.go_on(ep, self._attach_observation(trees[ep.tree_idx], turn, ph.stats))
                        else:
                            turn.parsed_at = time.perf_counter()
                            turn.job.payload = turn
                            ph.tools.start(turn.job)
                # Block on tools only when the engine is idle (a follower waits in `_admissions`).
                leads = self.admission is None or self.admission.leader
                self._tools_done(ph, wait=leads and not ph.inflight and not ph.ready)
        finally:
            if ph.inflight or ph.tools.pending():  # an error mid-call: the engine and the workers start clean next time
                self._abandon(ph.tools)
        self._commit(trees, episodes)
        st = ph.stats
        st.phase_s = time.perf_counter() - t_start
        if ph.finished_at:
            at = sorted(ph.finished_at)
            st.tail_s = at[-1] - at[min(len(at) - 1, int(0.9 * len(at)))]
        self.last_stats = st
        self.stats.add(st)

    def _tools_done(self, ph: "_Phase", wait: bool) -> None:
        """Attach the observations of the turns whose tools finished (or timed out)."""
        for job in ph.tools.collect(wait=wait):
            turn = job.payload
            ph.stats.tool_wait_s += time.perf_counter() - turn.parsed_at
            ph.stats.tool_s += job.seconds
            ph.stats.tool_timeouts += int(job.timed_out)
            ph.stats.tool_calls += len(job.calls)
            ph.go_on(turn.ep, self._attach_observation(ph.trees[turn.ep.tree_idx], turn, ph.stats))

    def _admissions(self, ph: "_Phase") -> Optional[list[_Episode]]:
        """The episodes whose next turn goes to the engine now; None when the call is over.

        On its own an engine takes every ready episode. The ranks of a multi-rank replica (vLLM
        tensor parallel) must feed their engines the same requests in the same order: the leader
        decides and broadcasts (`admission`), the others wait for those episodes' tools and follow."""
        busy = bool(ph.ready or ph.inflight or ph.tools.pending())
        if self.admission is None or self.admission.leader:
            admit = list(ph.ready) if busy else None
            if self.admission is not None:
                self.admission.agree(None if admit is None else [ep.ordinal for ep in admit])
            ph.ready.clear()
            return admit
        ids = self.admission.agree(None)
        if ids is None:  # the leader's episodes have all ended: so do ours once their tools are back
            while ph.tools.pending():
                self._tools_done(ph, wait=True)
            return None
        while not set(ids) <= {ep.ordinal for ep in ph.ready}:
            self._tools_done(ph, wait=True)
        picked = {ep.ordinal: ep for ep in ph.ready if ep.ordinal in set(ids)}
        for ep in picked.values():
            ph.ready.remove(ep)
        return [picked[i] for i in ids]

    def _tool_runner(self, episodes: int) -> ToolRunner:
        """The loop's tool workers, at least enough for `episodes` concurrent turns unless capped."""
        want = self.max_concurrent_tool_calls or max(episodes, 1)
        if self._tools is None or (self.max_concurrent_tool_calls is None and self._tools.max_concurrent < want):
            if self._tools is not None:
                self._tools.close()
            self._tools = ToolRunner(self.tool_timeout_s, want)
        return self._tools

    def _abandon(self, tools: ToolRunner) -> None:
        """Drain the engine's requests and drop the workers after a failed call."""
        try:
            while self.engine.in_flight():
                self.engine.poll()
        finally:
            tools.close()
            self._tools = None

    def _turn(self, tree: RolloutTree, ep: _Episode, comp: Completion, stats: RolloutStats) -> Optional[_PendingTurn]:
        """Record one generated turn; returns the pending tool/observation work, or None when the episode ended."""
        remaining = self.cfg.max_total_tokens - len(ep.prefix)
        cap = min(self.cfg.max_new_tokens_per_turn, remaining)
        if len(comp.token_ids) != len(comp.logprobs):
            raise RuntimeError(f"engine completion has {len(comp.token_ids)} tokens but {len(comp.logprobs)} log-probs")
        gen, lp = [int(t) for t in comp.token_ids[:cap]], [float(x) for x in comp.logprobs[:cap]]
        cut = comp.finish_reason == "length" or len(comp.token_ids) > cap
        ep.routes = extend_routes(ep.routes, comp.routing, len(ep.prefix) + len(gen))
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
                self._add(ep, turn_node(gen, lp, [], "final", parsed, info, reward=reward), _TURN)
                return None
            ep.state = after
            info["next_turn"] = True
            if ep.turns >= self.cfg.max_turns:
                info["truncated"] = "max_turns"
                self._end(ep, turn_node(gen, lp, [], "final", parsed, info), stats, _TURN)
                return None
            return _PendingTurn(ep, gen, lp, parsed, info, user=list(messages))
        if parsed.error is not None:
            stats.parse_errors += 1
            info["error"] = parsed.error
        if ep.turns >= self.cfg.max_turns:  # the limit ends the episode before the call runs
            info["truncated"] = "max_turns"
            self._end(ep, turn_node(gen, lp, [], "error" if parsed.error else "tool", parsed, info), stats, _TURN)
            return None
        job = None
        if parsed.error is None:
            fork, why = self._fork(ep.state, derive_seed(ep.seed, "tools", ep.turns))
            if fork is None:
                parsed.error, parsed.tool_calls = f"{why}; the tool calls were not run", []
                info["error"] = parsed.error
            else:
                job = ToolJob(self.env.step, fork, parsed.tool_calls)
        return _PendingTurn(ep, gen, lp, parsed, info, job=job)

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
            self._end(ep, turn_node(gen, lp, [], kind, parsed, info, "\n".join(observations)), stats, _OBSERVED)
            return False
        self._add(ep, turn_node(gen, lp, obs, kind, parsed, info, "\n".join(observations)), _OBSERVED, ep.state)
        ep.prefix += gen + obs
        return True

    # --- tree bookkeeping -------------------------------------------------------
    @staticmethod
    def _add(ep: _Episode, node: Node, phase: int, state: Optional[EpisodeState] = None) -> None:
        """Append a turn node to the episode (`state`: the environment after it, for non-terminal nodes)."""
        ep.nodes.append((phase, node, state))

    def _end(self, ep: _Episode, node: Node, stats: RolloutStats, phase: int) -> None:
        """Add `node` as a truncated episode's leaf (reward for 'no answer')."""
        node.reward = float(self.env.reward(ep.state, None))
        stats.truncated_episodes += 1
        stats.successes += int(node.reward > 0.5)
        self._add(ep, node, phase)

    def _finish_truncated(self, ep: _Episode, reason: str, stats: RolloutStats) -> None:
        """End an episode whose prefix already fills the token budget before its next turn."""
        if ep.owns_tip:  # its last turn node becomes the leaf
            phase, node, _ = ep.nodes[-1]
            node.reward = float(self.env.reward(ep.state, None))
            node.info["truncated"] = reason
            ep.nodes[-1] = (phase, node, None)
            stats.truncated_episodes += 1
            stats.successes += int(node.reward > 0.5)
        else:  # nothing generated yet (prompt or branch prefix too long): an empty leaf keeps the budget honest
            self._end(ep, Node(-1, [], [], [], kind="error", info={"truncated": reason}), stats, _BEFORE)

    @staticmethod
    def _commit(trees: list[RolloutTree], episodes: list[_Episode]) -> None:
        """Add the episodes' nodes to their trees in the order (turn, phase, episode) — the numbering
        of a loop that ran every episode's turn k together — and keep the states branching needs."""
        order = [(k, phase, ep, node, state) for ep in episodes for k, (phase, node, state) in enumerate(ep.nodes)]
        tips = {ep.ordinal: ep.start for ep in episodes}
        for _, _, ep, node, state in sorted(order, key=lambda x: (x[0], x[1], x[2].ordinal)):
            tree = trees[ep.tree_idx]
            tips[ep.ordinal] = tree.add_node(tips[ep.ordinal], node)
            if state is not None:
                tree.runtime["states"][tips[ep.ordinal]] = state
        for ep in episodes:
            if ep.routes is not None:
                attach_routes(trees[ep.tree_idx], tips[ep.ordinal], ep.routes)


# Numbering phases of a turn's node (`_commit`): an empty leaf for an episode that starts over the
# token limit, a node that ends the episode at its turn, a node completed by its observation.
_BEFORE, _TURN, _OBSERVED = 0, 1, 2
