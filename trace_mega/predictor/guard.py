"""The fallback guard: whether the next step may trust the predictor (docs/design.md §3.1).

Each fit measures the predictor on trees it has not trained on yet (`Predictor.fit`):
its Brier score and that of the equally held-out constant (the previous fit's mean
target). One step's skill 1 - brier / brier_constant is noise-dominated: a step
whose targets are nearly all equal has brier_constant ≈ 0 and a skill of -4 or -inf
for an error of 0.01. So the guard smooths the two Brier scores, not the ratio:

    B_s = d * B_{s-1} + (1 - d) * brier_s          (and C_s likewise for brier_constant)
    smoothed skill = 1 - B_s / C_s

— a pooled skill over an exponential window of ≈ 1 / (1 - d) steps, in which a step
weighs by how much there was to predict. The first measurement initialises both sums.
The next step uses the predictor-free allocator while the smoothed skill is below
`threshold` — and before the first measurement (the first two steps: the first fit has
no held-out constant), so a predictor is read only once it has been measured to be
no worse than the constant. The predictor keeps fitting (and being measured) either
way, so it takes over when its skill reaches the threshold.
"""

from __future__ import annotations

import math
from typing import Any, Mapping


class SkillGuard:
    """Smoothed held-out Brier skill of the predictor and the fallback decision it implies."""

    def __init__(self, decay: float, threshold: float = 0.0, enabled: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"guard decay must be in [0, 1), got {decay}")
        self.decay, self.threshold, self.enabled = decay, threshold, enabled
        self.brier = float("nan")
        self.brier_constant = float("nan")

    @property
    def skill(self) -> float:
        """1 - B / C of the smoothed Brier scores (NaN before any measurement; 0 when both are 0)."""
        if self.brier != self.brier:
            return float("nan")
        if self.brier_constant <= 0.0:
            return 0.0 if self.brier <= 0.0 else -math.inf
        return 1.0 - self.brier / self.brier_constant

    @property
    def fallback(self) -> bool:
        """Whether the next step should use the predictor-free allocator: until the predictor has been
        measured at or above the threshold on held-out trees (so also before any measurement)."""
        return self.enabled and not self.skill >= self.threshold  # NaN >= x is False

    def update(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Fold in one fit's `predictor/brier` and `predictor/brier_constant` (a fit with no
        previous constant, skill NaN, is skipped); returns the guard's metrics."""
        b, c, s = (
            metrics.get(k, float("nan")) for k in ("predictor/brier", "predictor/brier_constant", "predictor/skill")
        )
        if s == s and math.isfinite(b) and math.isfinite(c):
            if self.brier != self.brier:
                self.brier, self.brier_constant = float(b), float(c)
            else:
                d = self.decay
                self.brier = d * self.brier + (1.0 - d) * float(b)
                self.brier_constant = d * self.brier_constant + (1.0 - d) * float(c)
        return {"predictor/skill_smoothed": self.skill}

    def state_dict(self) -> dict[str, float]:
        return {"brier": self.brier, "brier_constant": self.brier_constant}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.brier, self.brier_constant = float(state["brier"]), float(state["brier_constant"])
