"""The success predictor Ṽψ(H): probability that continuing from a history succeeds.

Two backends behind `PREDICTORS`:

* `value_head` — a linear head on the policy's own final hidden states at each
  node's last token (no extra model). The policy's packed forward provides the
  hidden states; the head trains on them detached, so it never moves the policy.
* `small_model` — a separate small transformer over the packed tokens with the
  tree attention rule, so every prefix of a packed batch is scored in one pass.

Both score arbitrary nodes of a `PackedTrees` batch in one batched call
(`trace_mega.kernels.boundary_scoring` gathers the boundary hidden states,
applies the head and the sigmoid) and train online with binary cross-entropy
on the soft targets of `targets.predictor_samples`. On a trainer step the fit
reads the step record (`fit_step`): its layout and, for `value_head`, the policy
hidden states the update already computed for this data-parallel rank's trees;
each rank fits on its share and the gradients are summed over DP.
"""

from __future__ import annotations

import collections
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trace_mega.config import PredictorConfig
from trace_mega.kernels.boundary_scoring import boundary_scores
from trace_mega.predictor.calibration import Calibration, calibration
from trace_mega.predictor.targets import PredictorSamples, predictor_samples
from trace_mega.predictor.token_bag import PromptTokenBag
from trace_mega.registry import Registry
from trace_mega.rollout.tree import PackedTrees

log = logging.getLogger("trace_mega")


@dataclass
class PredictorFit:
    """What a fit returns: its metrics (`predictor/*`) and the held-out calibration they came from."""

    metrics: dict[str, float]
    calibration: Optional[Calibration]
    """Reliability of the predictions made before the update (None: no samples), for the plot."""


class Predictor(ABC, nn.Module):
    """Common interface: score nodes of a packed batch; fit on tree targets."""

    needs_policy_hidden: bool = False

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Mean target of the previous fit: the constant predictor the guard compares with
        # (NaN before the first fit). A buffer, so it is checkpointed with the weights.
        self.register_buffer("prior_mean", torch.tensor(float("nan")))
        # The same over the roots and over the prefixes alone: the anchors of `cfg.root_head`.
        self.register_buffer("prior_root_mean", torch.tensor(float("nan")))
        self.register_buffer("prior_prefix_mean", torch.tensor(float("nan")))
        # (packed, samples, hidden) of the previous replay_steps - 1 steps: this rank's share, so it
        # is checkpointed per rank (`fit_state`), not with the weights.
        self.replay: collections.deque = collections.deque(maxlen=cfg.replay_steps - 1)

    @abstractmethod
    def node_logits(self, packed: PackedTrees, nodes: torch.Tensor, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """(S,) logits of success for `nodes` (global ids) of `packed`; differentiable."""

    def logits(self, packed: PackedTrees, nodes: torch.Tensor, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """(S,) fp32 logits: the backend's, offset by the anchor (`cfg.anchor_at_mean`; with
        `cfg.root_head`, roots and prefixes each at their own previous mean target)."""
        out = self.node_logits(packed, nodes, hidden).float()
        if not self.cfg.anchor_at_mean:
            return out
        if self.cfg.root_head:
            is_root = (packed.node_parent[nodes] < 0).to(out.device)
            return out + torch.where(is_root, _anchor(self.prior_root_mean), _anchor(self.prior_prefix_mean)).to(out)
        return out + _anchor(self.prior_mean).to(out)

    @torch.no_grad()
    def predict(self, packed: PackedTrees, nodes: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(S,) predicted success probabilities in [0, 1]."""
        was_training = self.training
        self.eval()
        out = torch.sigmoid(self.logits(packed, nodes, hidden))
        self.train(was_training)
        return out

    def fit(
        self,
        packed: PackedTrees,
        samples: PredictorSamples,
        hidden: Optional[torch.Tensor] = None,
        replay: Sequence[tuple[PackedTrees, PredictorSamples, Optional[torch.Tensor]]] = (),
        group: Optional[dist.ProcessGroup] = None,
    ) -> PredictorFit:
        """`cfg.updates_per_step` BCE steps on `samples` plus the older `replay` batches (oldest
        first; a batch k steps old weighs `cfg.replay_decay`**k); returns its metrics and calibration.

        The calibration is measured on the predictions made *before* the update,
        i.e. on trees the predictor has not trained on yet (held-out by time),
        against the constant predictor that is equally held-out: the previous
        fit's mean target. `predictor/skill` < 0 means the predictor is worse
        than that constant (the trainer's fallback guard); NaN on the first fit.

        With `group` (data parallel) every rank passes its share of each batch (`samples.share`):
        the predictions and targets are summed over the group into the whole list for the
        calibration, and the gradients of the loss sums (each batch's divided by its whole
        count) are summed over the group, so every rank takes the update one process would.
        """
        if samples.num_total == 0:
            return PredictorFit({"predictor/samples": 0}, None)
        before = self.predict(packed, samples.node, hidden)
        dev = before.device  # the predictor's device (the metrics below move to the host)
        # (3, S_total): predictions, targets, is-root of the whole list; each rank fills its rows.
        whole = torch.zeros(3, samples.num_total, device=dev)
        whole[:, samples.positions.to(dev)] = torch.stack(
            [before.float(), samples.target.to(dev), samples.is_root.to(dev).float()]
        )
        if group is not None:
            dist.all_reduce(whole, group=group)
        before, target, is_root = whole[0].cpu(), whole[1].cpu(), whole[2].cpu()
        prior = float(self.prior_mean)
        cal = calibration(before, target, self.cfg.calibration_bins, constant=None if prior != prior else prior)
        skill = cal.skill if prior == prior else float("nan")
        roots = _root_calibration(before, target, is_root > 0, float(self.prior_root_mean))
        self.prior_mean.fill_(float(target.mean()))
        for prior, of_kind in ((self.prior_root_mean, is_root > 0), (self.prior_prefix_mean, is_root == 0)):
            if bool(of_kind.any()):  # a step without prefixes keeps the last prefix mean
                prior.fill_(float(target[of_kind].mean()))
        # Newest first: batch k of the list is k steps old.
        batches = [(packed, samples, hidden, 1.0)]
        for age, (p, s, h) in enumerate(reversed(list(replay)), start=1):
            if s.num_total:
                batches.append((p, s, h, self.cfg.replay_decay**age))
        norm = sum(w for *_, w in batches)
        loss = torch.zeros(())
        skipped = 0
        for _ in range(self.cfg.updates_per_step):
            loss = torch.zeros((), device=dev)
            for p, s, h, w in batches:
                if s.node.numel():  # a rank may hold none of a batch's samples
                    bce = F.binary_cross_entropy_with_logits(
                        self.logits(p, s.node, h), s.target.to(dev), weight=s.weight.to(dev), reduction="sum"
                    )
                    loss = loss + (w / norm) * bce / s.num_total
            self.optimizer.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
            loss = self._sum_grads(loss.detach(), group)
            if not self._finite(loss):  # a NaN/inf loss or gradient (the same on every rank) changes nothing
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            self.optimizer.step()
        if skipped:
            log.warning(
                "predictor fit: %d of %d updates skipped (non-finite loss or gradient)",
                skipped,
                self.cfg.updates_per_step,
            )
        metrics = {
            "predictor/loss": float(loss),
            "predictor/skipped": float(skipped),
            "predictor/brier": cal.brier,
            "predictor/brier_constant": cal.brier_constant,
            "predictor/skill": skill,
            "predictor/ece": cal.ece,
            "predictor/samples": samples.num_total,
            "predictor/prefix_fraction": float(1.0 - is_root.mean()),
            **roots,
        }
        return PredictorFit(metrics, cal)

    def _finite(self, loss: torch.Tensor) -> bool:
        """Whether `loss` and every gradient are finite (after the sum over data-parallel ranks)."""
        grads = [p.grad.flatten() for p in self.parameters() if p.grad is not None]
        return bool(torch.isfinite(torch.cat([loss.view(1).to(self.prior_mean.device), *grads])).all())

    def _sum_grads(self, loss: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """Sum the gradients (None: zero, a rank without samples) and `loss` over `group` in one
        collective; returns the loss."""
        if group is None:
            return loss
        params = [p for p in self.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.flatten() for p in params] + [loss.view(1).to(params[0].device)])
        dist.all_reduce(flat, group=group)
        for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        return flat[-1]

    def fit_step(
        self,
        packed: PackedTrees,
        hidden: torch.Tensor,
        trees: Sequence[int],
        group: Optional[dist.ProcessGroup] = None,
    ) -> PredictorFit:
        """`fit` on the step's final trees plus the replay window of the previous steps' batches.

        `packed` is the step's final layout; this data-parallel rank (`group`) fits on its share of
        it, `trees` (ascending: the trees of its policy update), whose (T_share, H) policy `hidden`
        states under the pre-update weights the update returned (`Learner.train_step`; read by
        `value_head` only). The window keeps only that share."""
        samples = predictor_samples(packed, self.cfg.prefix_sample_fraction)
        trees = list(trees)
        if len(trees) < packed.num_trees:
            samples = samples.share(packed, trees)
            packed = packed.select(trees)
        hidden = hidden if self.needs_policy_hidden else None
        out = self.fit(packed, samples, hidden, replay=list(self.replay), group=group)
        if self.replay.maxlen:
            self.replay.append((packed, samples, hidden))
        return out

    def build_optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def fit_state(self) -> dict[str, Any]:
        """What a resumed run needs besides the weights to fit as an uninterrupted one: the optimiser's
        moments and this rank's replay window (its size: the window's trees and hidden states)."""
        return {"optimizer": self.optimizer.state_dict(), "replay": list(self.replay)}

    def load_fit_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.replay.clear()
        self.replay.extend(state["replay"])


def _root_calibration(before: torch.Tensor, target: torch.Tensor, is_root: torch.Tensor, prior: float) -> dict:
    """Held-out Brier score of the roots alone, against the previous fit's mean root target (the
    constant `root_head` anchors at; NaN before it exists). The pooled skill is ≈ 95% prefixes and
    the root plan reads only the roots (docs/allocation.md "All-0 prompts and a level to learn")."""
    n = int(is_root.sum())
    if n == 0 or prior != prior:
        nan = float("nan")
        return {
            "predictor/root_samples": n,
            "predictor/root_brier": nan,
            "predictor/root_brier_constant": nan,
            "predictor/root_skill": nan,
        }
    cal = calibration(before[is_root], target[is_root], constant=prior)
    return {
        "predictor/root_samples": n,
        "predictor/root_brier": cal.brier,
        "predictor/root_brier_constant": cal.brier_constant,
        "predictor/root_skill": cal.skill,
    }


def _anchor(prior: torch.Tensor) -> torch.Tensor:
    """0-d logit of a prior mean (clamped to [1e-3, 1 - 1e-3]); 0 before the first fit (NaN)."""
    return torch.zeros(()) if bool(prior.isnan()) else torch.logit(prior.detach().cpu().clamp(1e-3, 1.0 - 1e-3))


PREDICTORS: Registry[type[Predictor]] = Registry("predictor backend")


@PREDICTORS.register("value_head")
class ValueHeadPredictor(Predictor):
    """sigmoid(w · h + b) on the policy's final hidden state at each node's last token
    (with `cfg.root_head`, a second (w, b) for the roots; with `cfg.root_token_bag`, plus the
    logit of a bag of the prompt's tokens, `PromptTokenBag`)."""

    needs_policy_hidden = True

    def __init__(self, cfg: PredictorConfig, hidden_size: int, vocab_size: int = 0, **_: object) -> None:
        super().__init__(cfg)
        self.head = nn.Linear(hidden_size, 1)
        self.root_head = nn.Linear(hidden_size, 1) if cfg.root_head else None
        for head in filter(None, (self.head, self.root_head)):
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)  # starts at 0.5 everywhere (or at the anchor): the uninformed prior
        self.root_bag = (
            PromptTokenBag(vocab_size, cfg.root_bag_pair_buckets, cfg.root_bag_hidden_size)
            if cfg.root_token_bag
            else None
        )  # adds exactly 0 until fitted
        self.build_optimizer()

    def node_logits(self, packed, nodes, hidden):
        if hidden is None:
            raise ValueError("value_head predictor needs the policy's hidden states (T, H)")
        positions = packed.node_last_token()[nodes].to(hidden.device)
        out = self._scores(hidden, positions, self.head)
        if self.root_head is None:
            return out
        is_root = (packed.node_parent[nodes] < 0).to(out.device)
        root = self._scores(hidden, positions, self.root_head)
        if self.root_bag is not None:
            bag = torch.zeros_like(root)
            bag[is_root] = self.root_bag(packed, nodes[is_root.cpu()]).to(root)
            root = root + bag
        return torch.where(is_root, root, out)

    @staticmethod
    def _scores(hidden: torch.Tensor, positions: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        return boundary_scores(
            hidden.detach(), positions, head.weight.view(-1), head.bias.view(()), return_logits=True
        )[1]


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        T, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(T, 3, self.heads, d // self.heads).unbind(1)  # (T, H, Dh) each
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = x + self.proj(att.transpose(0, 1).reshape(T, d))
        return x + self.mlp(self.norm2(x))


@PREDICTORS.register("small_model")
class SmallModelPredictor(Predictor):
    """A separate small transformer over the packed tokens (tree attention), value head at node ends."""

    def __init__(
        self,
        cfg: PredictorConfig,
        vocab_size: int,
        max_positions: int = 4096,
        width: int = 64,
        layers: int = 2,
        heads: int = 4,
        **_: object,
    ) -> None:
        super().__init__(cfg)
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_positions, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, 1)
        self.max_positions = max_positions
        self.build_optimizer()

    def encode(self, packed: PackedTrees) -> torch.Tensor:
        """(T, width) final hidden states of the packed stream."""
        dev = self.embed.weight.device
        node, exit_ = packed.token_node.to(dev), packed.token_node_exit.to(dev)
        idx = torch.arange(node.numel(), device=dev)
        # The tree rule of docs/PACKING.md, materialised: the predictor sees small batches.
        mask = (node[None, :] <= node[:, None]) & (node[:, None] <= exit_[None, :]) & (idx[None, :] <= idx[:, None])
        x = self.embed(packed.tokens.to(dev)) + self.pos(packed.position_ids.to(dev).clamp(max=self.max_positions - 1))
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def node_logits(self, packed, nodes, hidden=None):
        h = self.encode(packed)
        positions = packed.node_last_token()[nodes].to(h.device)
        return boundary_scores(h, positions, self.head.weight.view(-1), self.head.bias.view(()), return_logits=True)[1]


def build_predictor(cfg: PredictorConfig, *, hidden_size: int, vocab_size: int) -> Predictor:
    """The configured backend; `hidden_size` feeds value_head, `vocab_size` small_model."""
    return PREDICTORS.get(cfg.backend)(cfg, hidden_size=hidden_size, vocab_size=vocab_size)
