"""Ground-truth simulator of tree rollouts for allocation studies.

* A prompt has a latent success probability p ~ Beta(a, a). With a < 1 it is
  U-shaped: most mass sits near 0 and 1, as in the paper's Figure 2a.
* A trajectory has `turns` turns. Its prefix values V_0 = p, V_1, ..., V_T = r
  follow a two-point martingale: at turn t a fraction s_t of the remaining
  uncertainty is revealed,
      V_t = V + s_t (1 - V)  with probability V,   V_t = (1 - s_t) V  otherwise,
  with s_t ~ U(0, 2 * info_rate) for t < T and s_T = 1, so V_T = r ∈ {0, 1}.
  The process is Markov in V and E[V_t | V_{t-1}] = V_{t-1}. Therefore
  V_t = E[r | H_t] exactly, the ground truth a predictor estimates.
* Branching from a prefix of value V_t draws a fresh continuation, which by
  the martingale property succeeds with probability V_t. A prefix's K
  continuations are therefore Binomial(K, V_t) successes (their inner nodes
  are never branch points, docs/design.md §3.3).
* What a learned predictor may see: a prompt feature z = logit p + N(0, σ_z²)
  and, after turn t, a signal y_t = logit V_t + N(0, σ_y²).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SimConfig", "Prompts", "Rollouts", "Prefixes", "TreeSimulator", "logit"]


def logit(p: torch.Tensor, clip: float = 12.0) -> torch.Tensor:
    """log(p / (1-p)) clipped to [-clip, clip] (values at 0 and 1 stay finite)."""
    return torch.logit(p.to(torch.float64), eps=1e-12).clamp(-clip, clip)


@dataclass
class SimConfig:
    beta_a: float = 0.3
    """Prompt success p ~ Beta(beta_a, beta_a); < 1 is U-shaped."""
    turns: int = 4
    """Turns T per trajectory; the T - 1 intermediate prefixes are branch candidates."""
    info_rate: float = 0.35
    """Mean fraction of the remaining uncertainty revealed per non-final turn."""
    feature_noise: float = 1.0
    """σ_z of the observable prompt feature z = logit p + noise."""
    signal_noise: float = 1.0
    """σ_y of the observable per-turn signal y_t = logit V_t + noise."""

    def __post_init__(self) -> None:
        if self.beta_a <= 0 or self.turns < 2 or not 0 <= self.info_rate <= 0.5:
            raise ValueError("SimConfig needs beta_a > 0, turns >= 2, info_rate in [0, 0.5]")


@dataclass
class Prompts:
    """A step's candidate pool: latent success p (B,) and observable feature z (B,)."""

    p: torch.Tensor
    z: torch.Tensor


@dataclass
class Rollouts:
    """Bare rollouts: prompt index (R,), values (R, T+1) with V_0 = p and V_T = r, signals (R, T+1)."""

    prompt: torch.Tensor
    values: torch.Tensor
    signals: torch.Tensor

    @property
    def reward(self) -> torch.Tensor:
        return self.values[:, -1]


@dataclass
class Prefixes:
    """Candidate branch points: prefix (j, t) of bare rollout j after turn t, t = 1..T-1, flattened (P,)."""

    rollout: torch.Tensor
    depth: torch.Tensor
    value: torch.Tensor
    signal: torch.Tensor
    group: torch.Tensor
    reward: torch.Tensor


class TreeSimulator:
    """Samples prompts, bare rollouts, candidate prefixes and continuations with known values."""

    def __init__(self, cfg: SimConfig | None = None, seed: int = 0) -> None:
        self.cfg = cfg or SimConfig()
        # Prompts have their own stream: allocators run with one seed see the same prompt pools.
        self.prompt_gen = torch.Generator().manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed + 1_000_003)

    def _normal(self, *shape, gen: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=gen or self.gen, dtype=torch.float64)

    def sample_prompts(self, B: int) -> Prompts:
        """B fresh prompts: p ~ Beta(a, a) as a ratio of two seeded Gamma(a) draws, and their features."""
        # torch.distributions takes no generator; _standard_gamma is the sampler it wraps.
        shape = torch.full((2, B), self.cfg.beta_a, dtype=torch.float64)
        g = torch._standard_gamma(shape, generator=self.prompt_gen)  # (2, B)
        p = g[0] / (g[0] + g[1]).clamp(min=1e-300)
        return Prompts(p=p, z=logit(p) + self.cfg.feature_noise * self._normal(B, gen=self.prompt_gen))

    def bare_rollouts(self, prompts: Prompts, m: torch.Tensor) -> Rollouts:
        """m[i] martingale trajectories from prompt i, all turns at once: (R, T+1)."""
        prompt = torch.repeat_interleave(torch.arange(m.numel()), m.cpu())
        R, T = prompt.numel(), self.cfg.turns
        s = torch.rand(R, T, generator=self.gen, dtype=torch.float64) * (2 * self.cfg.info_rate)
        s[:, -1] = 1.0  # the final turn reveals the outcome
        u = torch.rand(R, T, generator=self.gen, dtype=torch.float64)
        values = torch.empty(R, T + 1, dtype=torch.float64)
        values[:, 0] = prompts.p[prompt]
        for t in range(T):  # loop over turns only (a handful), batched over every rollout
            v = values[:, t]
            up = u[:, t] < v
            values[:, t + 1] = torch.where(up, v + s[:, t] * (1 - v), (1 - s[:, t]) * v)
        values[:, -1] = values[:, -1].round()  # exact 0/1 (s_T = 1 up to rounding)
        signals = logit(values) + self.cfg.signal_noise * self._normal(R, T + 1)
        return Rollouts(prompt=prompt, values=values, signals=signals)

    def prefixes(self, rollouts: Rollouts) -> Prefixes:
        """Every intermediate prefix (t = 1..T-1) of every bare rollout, rollout-major order."""
        R, T = rollouts.values.shape[0], self.cfg.turns
        rollout = torch.arange(R).repeat_interleave(T - 1)
        depth = torch.arange(1, T).repeat(R)
        return Prefixes(
            rollout=rollout,
            depth=depth,
            value=rollouts.values[rollout, depth],
            signal=rollouts.signals[rollout, depth],
            group=rollouts.prompt[rollout],
            reward=rollouts.reward[rollout],
        )

    def continue_from(self, prefixes: Prefixes, K: torch.Tensor) -> torch.Tensor:
        """Successes among K[p] fresh continuations from each prefix: Binomial(K, V_t) (P,)."""
        return torch.binomial(K.to(torch.float64), prefixes.value, generator=self.gen).long()
