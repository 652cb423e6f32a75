"""Value predictors for the simulator: oracle, calibrated-noisy, and learned online from the trees.

All share one interface: `predict_roots(prompts) -> (B,)`,
`predict_prefixes(prompts, prefixes) -> (P,)`, and `update(data) -> metrics`
(called once per step with the targets of the newest trees, docs/design.md §3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trace_mega.sim.simulator import Prefixes, Prompts, SimConfig

__all__ = ["TrainingData", "Predictor", "OraclePredictor", "NoisyPredictor", "LearnedPredictor", "build_predictor"]


@dataclass
class TrainingData:
    """Predictor targets from one step's trees: roots of active prompts, and every candidate prefix."""

    root_index: torch.Tensor
    """(A,) prompt index of each active prompt."""
    root_target: torch.Tensor
    """(A,) mean reward of all leaves of that prompt's tree."""
    prefix_target: torch.Tensor
    """(P,) mean reward of the leaves under each candidate prefix."""
    prompts: Prompts
    prefixes: Prefixes


class Predictor:
    """Estimates V(H) = P(success | H) at roots and prefixes."""

    name = "base"

    def predict_roots(self, prompts: Prompts) -> torch.Tensor:
        raise NotImplementedError

    def predict_prefixes(self, prompts: Prompts, prefixes: Prefixes) -> torch.Tensor:
        raise NotImplementedError

    def update(self, data: TrainingData) -> dict:
        """Learn from the newest trees; fixed predictors learn nothing."""
        return {}


class OraclePredictor(Predictor):
    """The true values: p at the root, V_t = E[r | H_t] at prefixes."""

    name = "oracle"

    def predict_roots(self, prompts):
        return prompts.p

    def predict_prefixes(self, prompts, prefixes):
        return prefixes.value


class NoisyPredictor(Predictor):
    """A calibrated noisy predictor: the posterior mean after n pseudo-rollouts.

    It draws k ~ Binomial(n, V) and reports (a + k) / (2a + n), the posterior
    mean of V under the prior Beta(a, a) (a = the simulator's beta_a). At the
    roots this prior is the true distribution of p, so the predictor is exactly
    calibrated: E[p | v̂] = v̂. At prefixes it uses the same prior, which is only
    approximately right. `noise` in [0, 1] sets n = 1/noise² - 1 (rounded):
    0 is the oracle, 1 (n = 0) says 0.5 everywhere, 0.5 is n = 3, 0.25 is n = 15.
    """

    name = "noisy"

    def __init__(self, noise: float, prior_a: float = SimConfig.beta_a, seed: int = 0) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must lie in [0, 1], got {noise}")
        self.noise = noise
        self.n = None if noise == 0 else int(round(1.0 / noise**2 - 1.0))
        self.prior_a = prior_a
        self.gen = torch.Generator().manual_seed(seed)

    def _garble(self, value: torch.Tensor) -> torch.Tensor:
        if self.n is None:
            return value
        k = torch.binomial(torch.full_like(value, float(self.n)), value, generator=self.gen)
        return (self.prior_a + k) / (2 * self.prior_a + self.n)

    def predict_roots(self, prompts):
        return self._garble(prompts.p)

    def predict_prefixes(self, prompts, prefixes):
        return self._garble(prefixes.value)


class LearnedPredictor(Predictor):
    """A small MLP trained online (Adam, BCE on soft targets) on the newest step's trees.

    Inputs are only what a real predictor could see: the prompt feature z, the
    turn signal y_t (0 at the root), the relative depth t / T, and a prefix flag.
    It starts uninformed (about 0.5 everywhere), so early steps look like uniform.
    """

    name = "learned"

    def __init__(
        self,
        turns: int = SimConfig.turns,
        hidden: int = 16,
        lr: float = 0.03,
        updates_per_step: int = 30,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.turns = turns
        self.w1 = (torch.randn(4, hidden, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
        self.b1 = torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
        self.w2 = (torch.randn(hidden, 1, generator=g, dtype=torch.float64) * 0.01).requires_grad_()
        self.b2 = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        self.opt = torch.optim.Adam([self.w1, self.b1, self.w2, self.b2], lr=lr)
        self.updates_per_step = updates_per_step

    def _features(self, z, y, depth, is_prefix):
        return torch.stack([z / 4.0, y / 4.0, depth / self.turns, is_prefix], dim=1)  # (N, 4)

    def _logits(self, x):
        return (torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2).squeeze(1)

    def _root_x(self, prompts):
        zero = torch.zeros_like(prompts.z)
        return self._features(prompts.z, zero, zero, zero)

    def _prefix_x(self, prompts, prefixes):
        return self._features(
            prompts.z[prefixes.group],
            prefixes.signal,
            prefixes.depth.to(torch.float64),
            torch.ones_like(prefixes.signal),
        )

    def predict_roots(self, prompts):
        with torch.no_grad():
            return torch.sigmoid(self._logits(self._root_x(prompts)))

    def predict_prefixes(self, prompts, prefixes):
        with torch.no_grad():
            return torch.sigmoid(self._logits(self._prefix_x(prompts, prefixes)))

    def update(self, data):
        x_root = self._root_x(data.prompts)[data.root_index]
        x = torch.cat([x_root, self._prefix_x(data.prompts, data.prefixes)])
        y = torch.cat([data.root_target, data.prefix_target]).to(torch.float64)
        if y.numel() == 0:
            return {"predictor_loss": float("nan"), "prefix_sample_fraction": float("nan")}
        for _ in range(self.updates_per_step):
            loss = F.binary_cross_entropy_with_logits(self._logits(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return {"predictor_loss": loss.item(), "prefix_sample_fraction": data.prefix_target.numel() / y.numel()}


def build_predictor(kind: str, noise: float = 0.5, sim_cfg: SimConfig | None = None, seed: int = 0) -> Predictor:
    """'oracle' | 'noisy' (with `noise`) | 'learned'."""
    sim_cfg = sim_cfg or SimConfig()
    if kind == "oracle":
        return OraclePredictor()
    if kind == "noisy":
        return NoisyPredictor(noise, prior_a=sim_cfg.beta_a, seed=seed)
    if kind == "learned":
        return LearnedPredictor(turns=sim_cfg.turns, seed=seed)
    raise KeyError(f"unknown predictor {kind!r}; valid: learned, noisy, oracle")
