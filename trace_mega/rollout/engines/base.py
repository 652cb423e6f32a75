"""The generation-engine contract and its registry.

Engines take token-id prefixes and return sampled continuations with their
log-probs. Generation stops at any of `stop_token_ids` (the end of a tool call
or of the turn), at `max_new_tokens`, or at the engine's EOS. Engines that can
reuse the KV cache of shared prefixes (branching from a tree node) report per
completion how many prefill tokens they avoided (the agent loop sums them).

Two ways in (docs/engines.md):
* request level, what the agent loop uses: `submit(request_id, prefix,
  sampling)` hands the engine one request whenever it is ready, and each
  `poll()` advances the engine by one scheduling step and returns the requests
  that finished in it. An engine with continuous batching (torch, vLLM) lets
  new requests join between decode steps; the base class's fallback runs the
  requests queued since the last poll as one `generate` call.
* batch level: `generate(prefixes, sampling)` returns one completion per prefix.
A request's tokens depend only on its prefix and seed, never on what else is
in the engine (up to float rounding of batched kernels).

A training run starts its engine with `build_engine(EngineSetup)`
(engines/__init__.py): the registered class's `launch` reads its own
construction arguments from the setup and prepares what it needs to start
(e.g. an HF directory of the initial weights), on every rank, and builds the
engine on the ranks of each rollout replica that run it (docs/design.md §6, "System shape").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Literal, Optional

import torch

from trace_mega.config import RolloutConfig
from trace_mega.registry import Registry


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation ends after emitting one of these (the stop token is included in the output)."""
    seed: Optional[int] = None
    """Base seed of the call: request i uses seed + i (when `seeds` is not given)."""
    seeds: Optional[list[int]] = None
    """One seed per request (the agent loop derives them from the episode, never from batching or
    from which replica serves it); overrides `seed`."""

    def request_seed(self, i: int) -> Optional[int]:
        """The seed of request i of the call (None: unseeded)."""
        if self.seeds is not None:
            return int(self.seeds[i])
        return None if self.seed is None else self.seed + i

    def batch_key(self) -> tuple:
        """What requests must share to be sampled in one batch (everything but the seeds)."""
        return (self.temperature, self.top_p, self.max_new_tokens, tuple(self.stop_token_ids))


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the sampling distribution's base model (temperature 1)."""
    finish_reason: Literal["stop", "length"]
    cached_prefix_tokens: int = 0
    """Prefix tokens whose KV came from the cache instead of prefill."""
    routing: Optional[torch.Tensor] = None
    """With routing capture: (len(prefix) + len(token_ids) - 1, MoE layers, top-k) experts routed for
    every token the engine fed (the prompt, then each sampled token but the last; engines/routing.py)."""


@dataclass
class EngineSetup:
    """What a training run hands an engine class to start it (`Engine.launch`)."""

    rollout: RolloutConfig
    """The run's rollout config (engine name, prefix caching, vLLM memory / block size, lengths)."""
    seed: int
    """Run seed (engine-level default; requests carry their own seeds)."""
    dtype: str
    """Compute dtype the engine runs the policy in (the learner's `model.params_dtype` unless
    `rollout.dtype` says otherwise): the behaviour log-probs then match the learner's."""
    eos_token_ids: list[int]
    """Stop tokens of the tokenizer, added to every request."""
    device: torch.device
    """The learner's device on this rank."""
    policy_config: Any
    """transformers config of the policy (an in-process engine builds its network from it)."""
    checkpoint_dir: Optional[str]
    """HF checkpoint the policy was initialised from, None for a random init."""
    write_checkpoint: Callable[[Path], Path]
    """Writes the current policy as an HF directory and returns it; collective over the learner's ranks."""
    work_dir: Path
    """Where an engine may write what it needs to start."""
    host: bool
    """Whether this rank leads its rollout replica (an in-process engine runs there only; the other
    ranks join collective preparation)."""
    replica_size: int = 1
    """Ranks in this rank's rollout replica (its model-parallel group, TP x PP)."""
    distributed: bool = False
    """Launched by torchrun with more than one rank (an engine that spans ranks, like vLLM's
    `external_launcher`, then starts on every rank of the replica)."""
    capture_routing: bool = False
    """Return each request's MoE routes (`Completion.routing`): `model.moe_routing_replay: rollout`."""


class Engine(ABC):
    """Base class of rollout engines.

    Subclasses implement `generate` (and may rely on the batch-per-poll fallback of
    `submit` / `poll`), or implement `submit` / `poll` / `in_flight` with continuous batching
    and get `generate` from `generate_by_requests`.
    """

    @classmethod
    def launch(cls, setup: EngineSetup) -> Optional["Engine"]:
        """Start this engine for a training run. Every rank calls it (preparation may be collective);
        it returns the engine on the hosting rank (`setup.host`) and None on the others."""
        raise TypeError(f"{cls.__name__} cannot be started from a training config (it has no `launch`)")

    @abstractmethod
    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Sample one continuation per prefix."""

    def submit(self, request_id: Hashable, prefix: list[int], sampling: SamplingParams) -> None:
        """Queue one request; `sampling.seed` is its seed (`seeds` is ignored). Ids must be unique
        among the requests in flight."""
        queue = self.__dict__.setdefault("_queued", {})
        if request_id in queue:
            raise ValueError(f"submit: request {request_id!r} is already in flight")
        if not prefix:
            raise ValueError("submit: a request needs at least one prefix token")
        queue[request_id] = (list(prefix), sampling)

    def poll(self) -> list[tuple[Hashable, Completion]]:
        """Advance by one scheduling step; the (request id, completion) pairs that finished in it.

        Fallback for engines without continuous batching: everything queued since the last
        poll runs as one `generate` call per distinct sampling setting, and all of it finishes.
        """
        queue = self.__dict__.pop("_queued", {})
        groups: dict[tuple, list[Hashable]] = {}
        for rid, (_, sampling) in queue.items():
            groups.setdefault(sampling.batch_key(), []).append(rid)
        done = []
        for ids in groups.values():
            first = queue[ids[0]][1]
            batch = SamplingParams(
                temperature=first.temperature,
                top_p=first.top_p,
                max_new_tokens=first.max_new_tokens,
                stop_token_ids=list(first.stop_token_ids),
                seeds=[queue[r][1].request_seed(0) for r in ids],
            )
            if any(s is None for s in batch.seeds):
                batch.seeds = None  # unseeded requests: the engine's own randomness
            completions = self.generate([queue[r][0] for r in ids], batch)
            if len(completions) != len(ids):
                raise RuntimeError(f"engine returned {len(completions)} completions for {len(ids)} prefixes")
            done += list(zip(ids, completions))
        return done

    def in_flight(self) -> int:
        """Requests submitted and not yet returned by `poll`."""
        return len(self.__dict__.get("_queued", {}))

    def generate_by_requests(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """`generate` through `submit` / `poll` (for engines whose native path is request level)."""
        if self.in_flight():
            raise RuntimeError("generate: the engine has requests in flight; poll them first")
        for i, prefix in enumerate(prefixes):
            one = SamplingParams(
                sampling.temperature,
                sampling.top_p,
                sampling.max_new_tokens,
                list(sampling.stop_token_ids),
                seed=sampling.request_seed(i),
            )
            self.submit(i, prefix, one)
        out: list[Optional[Completion]] = [None] * len(prefixes)
        while self.in_flight():
            for i, comp in self.poll():
                out[i] = comp
        return out  # type: ignore[return-value]

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights in memory (HF parameter names) and drop stale caches."""

    def sleep(self) -> None:
        """Free accelerator memory while the learner trains (no-op where irrelevant)."""

    def wake_up(self) -> None:
        """Undo `sleep`."""

    def close(self) -> None:
        """Release the engine."""


ENGINES: Registry[type[Engine]] = Registry("rollout engine")
