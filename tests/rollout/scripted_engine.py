"""A scripted generation engine for the agent-loop tests (a real `Engine`, not a mock).

A *script* maps (prefix token ids, per-request RNG) to the token ids the
"model" wants to emit. The engine applies the sampling contract on top:
generation ends after the first stop token (included) or after
`max_new_tokens` (finish "length"); request i is seeded with `sampling.request_seed(i)`.
Log-probs are a deterministic function of (prefix length, position) so tests
can check that they land on the right tokens. Every call is recorded.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

import torch

from trace_mega.rollout.engines.base import Completion, Engine, SamplingParams

Script = Callable[[list[int], random.Random], list[int]]


def scripted_logprob(prefix_len: int, position: int) -> float:
    """The log-prob the engine reports for the token at `position` of a completion after `prefix_len` tokens."""
    return -0.001 * ((prefix_len * 31 + position * 7) % 997) - 0.01


class ScriptedEngine(Engine):
    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        self.calls.append(([list(p) for p in prefixes], sampling))
        out = []
        stops = set(sampling.stop_token_ids)
        for i, prefix in enumerate(prefixes):
            rng = random.Random(sampling.request_seed(i) or 0)
            want = list(self.script(list(prefix), rng))
            ids, reason = [], "length"
            for tok in want:
                if len(ids) == sampling.max_new_tokens:
                    break
                ids.append(int(tok))
                if tok in stops:
                    reason = "stop"
                    break
            else:
                if len(ids) < sampling.max_new_tokens:
                    reason = "stop"  # the script ended its turn (an EOS the engine does not emit)
            lps = [scripted_logprob(len(prefix), j) for j in range(len(ids))]
            out.append(Completion(token_ids=ids, logprobs=lps, finish_reason=reason))
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:  # a script has no weights; consume the iterator like a real engine
            pass
