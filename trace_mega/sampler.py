"""Deterministic, resumable prompt order.

Each epoch is a fresh permutation of the task indices drawn from
(seed, epoch), so the order after a resume is the order without one: the
sampler's whole state is two integers saved with every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerState:
    epoch: int = 0
    """Completed passes over the task set."""
    cursor: int = 0
    """Position inside the current epoch's permutation."""


class PromptSampler:
    def __init__(self, num_tasks: int, seed: int, state: SamplerState | None = None) -> None:
        if num_tasks < 1:
            raise ValueError("the task set is empty")
        self.num_tasks = num_tasks
        self.seed = seed
        self.state = state or SamplerState()
        self._perm = self._permutation(self.state.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_tasks, generator=g).tolist()

    def next(self, n: int) -> list[int]:
        """The next `n` task indices (wrapping into new epochs; no repeats within a batch when n <= num_tasks)."""
        out: list[int] = []
        while len(out) < n:
            if self.state.cursor == self.num_tasks:
                self.state = SamplerState(self.state.epoch + 1, 0)
                self._perm = self._permutation(self.state.epoch)
            take = min(n - len(out), self.num_tasks - self.state.cursor)
            out += self._perm[self.state.cursor : self.state.cursor + take]
            self.state.cursor += take
        return out
