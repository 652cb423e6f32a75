"""The generation-engine contract and its registry.

Engines take token-id prefixes and return sampled continuations with their
log-probs. Generation stops at any of `stop_token_ids` (the end of a tool call
or of the turn), at `max_new_tokens`, or at the engine's EOS. Engines that can
reuse the KV cache of shared prefixes (branching from a tree node) report how
many prefill tokens they avoided.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional

import torch

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
    """Per-request seed; request i uses seed + i, so results do not depend on batching."""


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the sampling distribution's base model (temperature 1)."""
    finish_reason: Literal["stop", "length"]
    cached_prefix_tokens: int = 0
    """Prefix tokens whose KV came from the cache instead of prefill."""


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    """Prompt tokens actually prefilled."""
    cached_prefill_tokens: int = 0
    """Prompt tokens served from the prefix cache (prefill avoided)."""
    generated_tokens: int = 0


class Engine(ABC):
    """Base class of rollout engines."""

    def __init__(self) -> None:
        self.stats = EngineStats()

    @abstractmethod
    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Sample one continuation per prefix."""

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
