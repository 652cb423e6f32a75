"""Simulated tool latency for the synthetic environments (`env.options.tool_latency_ms`).

Real tools take 10 ms to seconds (a search API, a code sandbox, a remote
simulator); the synthetic ones answer in microseconds. `ToolLatency` makes a
synthetic tool call sleep a draw — fixed (`sigma` 0) or lognormal with the
given median — seeded by a key the caller derives from the call (never from
the episode's own random stream, so turning latency on changes no trajectory:
only when things happen, not what happens). It runs inside the tool call, on
the agent loop's tool worker.
"""

from __future__ import annotations

import hashlib
import math
import random
import time


class ToolLatency:
    """Sleep `median_ms * exp(sigma * z)` per call, z ~ N(0, 1) seeded by the call's key (0 ms: off)."""

    def __init__(self, median_ms: float = 0.0, sigma: float = 0.0) -> None:
        if median_ms < 0 or sigma < 0:
            raise ValueError(
                f"tool latency: need tool_latency_ms >= 0 and tool_latency_sigma >= 0, got {median_ms}, {sigma}"
            )
        self.median_ms, self.sigma = float(median_ms), float(sigma)

    def seconds(self, key: object) -> float:
        """The delay of the call identified by `key` (anything with a stable `repr`)."""
        if self.median_ms == 0:
            return 0.0
        if self.sigma == 0:
            return self.median_ms / 1000
        seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
        return self.median_ms * math.exp(self.sigma * random.Random(seed).gauss(0.0, 1.0)) / 1000

    def wait(self, key: object) -> None:
        delay = self.seconds(key)
        if delay > 0:
            time.sleep(delay)
