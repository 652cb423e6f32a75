"""`Learner`: the trainer's one view of the Megatron-Core policy and its frozen reference.

It owns the parallel state, the policy (megatron DDP + optimizer + LR
schedule), the frozen reference (a copy of the initial policy, built only when
the KL term or TRACE-C needs it), and exposes what the step loop needs:

* `hidden_states(packed)` — policy final hidden states of a layout (no grad), for
  the predictor's value head, on every rank;
* `score_nodes(packed, nodes, score, needs_hidden)` — the predictor's scores of nodes, the
  trees split over data-parallel ranks (each encodes only its share);
* `probe(packed, trees, tokenize, template)` — TRACE-C's ℓ̄ at every tool boundary from
  the reference (one packed forward per group of trees, split over DP);
* `train_step(packed, advantages)` — the step's policy update: epochs x mini-batches of
  whole trees, one optimiser step each; it returns a `PolicyUpdate`: the metrics and the
  hidden states of this DP rank's trees under the pre-update weights (from the training
  forward when the update is on-policy, else from the no-grad old-log-prob forward), so the
  predictor fits on each rank's share without another policy forward (docs/step.md);
* `old_logprobs(packed, return_hidden)` — one no-grad policy forward: the log-probs of the
  loss tokens (the PPO reference) and optionally every token's hidden state;
* `sync_weights(engine)` — the in-memory weight sync to a rollout engine (the
  collective HF-named export runs on every rank); `save` / `load` — megatron
  dist checkpoints.

Mini-batches and micro-batches hold whole trees (so every group-relative quantity is local
to one micro-batch); micro-batches are split over data-parallel ranks, and each is padded to a
multiple of the TP size with one padding node that attends only to itself and carries no loss.
The PPO ratio is taken against the policy before the step's first update (`loss.old_logprobs:
learner`) or the engine's sampling log-probs (`behaviour`); with one mini-batch and one epoch
the learner's old log-probs are the current ones detached (ratio 1, the on-policy gradient).
Rollout importance weights (`loss.rollout_is`) correct for the engine-vs-learner mismatch
(docs/credit.md).

Pipeline stages: every forward goes through megatron's schedule (`train_step`, or
`forward_only` for the no-grad passes), so each stage runs only its layers; what the
last stage computes (hidden states, log-probs, probe values) is broadcast over the
PP group where another stage needs it (`_to_all_stages`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from trace_mega.config import TrainConfig
from trace_mega.credit.probe import ProbeResult, reference_probe
from trace_mega.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trace_mega.learner.convert import export_hf, load_hf_into, save_hf
from trace_mega.learner.hf_files import policy_hf_config
from trace_mega.learner.models import build_model, model_config_from_hf, output_weight, unwrap
from trace_mega.learner.optim import (
    build_optimizer,
    forward_only,
    megatron_packed_forward,
    train_step,
    update_metrics,
    wrap_ddp,
)
from trace_mega.learner.parallel import ParallelGroups, init_parallel
from trace_mega.learner.routing_replay import install, own_routing_sums, take_metrics
from trace_mega.objective.advantages import Advantages
from trace_mega.objective.losses import LossBatch, aggregation_mode, compute_loss, signal_scale, unit_count
from trace_mega.objective.mismatch import correction_weights, rollout_correction
from trace_mega.ops.attention import tree_attention_mask
from trace_mega.ops.balance import balanced_bins, contrast_bins
from trace_mega.ops.logprobs import packed_token_logprobs
from trace_mega.rollout.tree import PackedTrees, RolloutTree

if TYPE_CHECKING:
    from trace_mega.rollout.engines import Engine


NodeScorer = Callable[[PackedTrees, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
"""(layout, (S,) node ids in it, (T, H) policy hidden states of it or None) -> (S,) scores."""


@dataclass
class PolicyUpdate:
    """What `Learner.train_step` returns: the update's metrics and the states the predictor fits on."""

    metrics: dict[str, float]
    """`loss/*`, `mismatch/*` (and `moe/*`) over all optimiser steps of the update (`update_metrics`)."""
    hidden: torch.Tensor
    """(T_share, H) policy final hidden states, under the pre-update weights, of the trees `trees`
    (the layout `packed.select(trees)`), on every pipeline stage."""
    trees: list[int]
    """The trees (ascending indices into the step's layout) this data-parallel rank trained on."""


def resolve_model_config(cfg: TrainConfig):
    """The `ModelConfig` in force: from the HF checkpoint's config.json when one is given."""
    if cfg.model.hf_checkpoint is None:
        return cfg.model
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model.hf_checkpoint)
    return model_config_from_hf(hf, params_dtype=cfg.model.params_dtype, attention_backend=cfg.model.attention_backend)


class Learner:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.groups: ParallelGroups = init_parallel(cfg.parallel, seed=cfg.seed)
        g = self.groups
        self.model_cfg = resolve_model_config(cfg)
        policy = build_model(self.model_cfg, cfg.parallel, g.pgs, g.device, g.pp_rank, g.pp_size)
        if cfg.model.hf_checkpoint:
            load_hf_into(policy, cfg.model.hf_checkpoint, g)
        # R3 on the policy only: the reference routes on its own (docs/learner.md).
        self.replays_routes = bool(self.model_cfg.num_experts) and cfg.model.moe_routing_replay == "rollout"
        if self.replays_routes:
            install(policy)
        self.chunks = [wrap_ddp(policy, cfg.parallel, g)]
        self.optimizer, self.scheduler = build_optimizer(self.chunks, cfg.optim, cfg.parallel, g)
        self.reference = None
        if cfg.loss.kl_coef > 0 or cfg.credit.enabled:
            self.reference = build_model(self.model_cfg, cfg.parallel, g.pgs, g.device, g.pp_rank, g.pp_size)
            self.reference.load_state_dict(policy.state_dict())
            self.reference.requires_grad_(False).eval()

    # --- views ---------------------------------------------------------------------
    @property
    def policy(self) -> torch.nn.Module:
        return unwrap(self.chunks[0])

    @property
    def hidden_size(self) -> int:
        return self.model_cfg.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.model_cfg.params_dtype)

    def _vocab_start(self, net: torch.nn.Module) -> int:
        """Vocab id of this TP rank's first LM-head row (the vocabulary is padded to a multiple of TP)."""
        return self.groups.tp_rank * output_weight(net).shape[0]

    def _inputs(self, packed: PackedTrees, trees: slice = slice(None)) -> tuple[torch.Tensor, ...]:
        """(1, Tp) ids and positions and the (2, 1, Tp) tree mask of `packed`'s trees `trees`,
        padded to a multiple of the TP size (trees are independent, so a range of them is a
        contiguous slice of the stream with its node ids shifted)."""
        first, last = range(packed.num_trees)[trees][0], range(packed.num_trees)[trees][-1]
        n0, n1 = int(packed.tree_node_offset[first]), int(packed.tree_node_offset[last + 1])
        t0 = int(packed.node_start[n0])
        t1 = int(packed.node_start[n1]) if n1 < packed.num_nodes else packed.num_tokens
        pad = (-(t1 - t0)) % self.groups.tp_size
        dev = self.groups.device
        tokens = torch.cat([packed.tokens[t0:t1], packed.tokens.new_zeros(pad)])
        positions = torch.cat([packed.position_ids[t0:t1], torch.arange(pad)])
        # Padding is one extra node past the slice's last: it sees only itself, nothing sees it.
        n_pad = n1 - n0
        node = torch.cat([packed.token_node[t0:t1] - n0, torch.full((pad,), n_pad)])
        node_exit = torch.cat([packed.token_node_exit[t0:t1] - n0, torch.full((pad,), n_pad)])
        mask = tree_attention_mask(node.to(dev), node_exit.to(dev))
        return tokens[None].to(dev), positions[None].to(dev), mask

    def _batch(self, packed: PackedTrees, trees: slice = slice(None), routing: Optional[torch.Tensor] = None) -> dict:
        """Model inputs of `_inputs`, and the (1, T, L, k) rows of `routing` (the layout's (T, L, k)
        engine routes, kept on the host: the model moves one forward's layers to the device)."""
        ids, pos, mask = self._inputs(packed, trees)
        out = {"input_ids": ids, "position_ids": pos, "tree_mask": mask}
        if routing is not None:
            out["routing"] = routing[packed.tree_tokens(range(packed.num_trees)[trees])][None]
        return out

    def _to_all_stages(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the last pipeline stage holds it, on every stage of this rank's PP group (in place;
        the other stages pass a tensor of the same shape and dtype)."""
        g = self.groups
        if g.pp_size > 1:
            dist.broadcast(t, src=dist.get_global_rank(g.pgs.pp, g.pp_size - 1), group=g.pgs.pp)
        return t

    @torch.no_grad()
    def hidden_states(self, packed: PackedTrees, routing: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(T, H) policy hidden states after the final norm (no grad) on every rank: one pipelined
        forward of runs of consecutive trees holding at most `parallel.micro_batch_tokens` tokens
        each, computed on the last stage and broadcast over PP. `routing`: (T, L, k) MoE routes to replay."""
        hidden = torch.zeros(packed.num_tokens, self.hidden_size, device=self.groups.device, dtype=self.dtype)
        if packed.num_tokens == 0:
            return hidden
        sizes = packed.tree_num_tokens().tolist()
        runs, first, used = [], 0, 0
        for i, n in enumerate(sizes):
            if i > first and used + n > self.cfg.parallel.micro_batch_tokens:
                runs.append(slice(first, i))
                first, used = i, 0
            used += n
        runs.append(slice(first, len(sizes)))
        out = forward_only(self.chunks[0], [self._batch(packed, r, routing) for r in runs])
        if out:
            hidden.copy_(torch.cat([h[0, : sum(sizes[r])] for h, r in zip(out, runs)]))
        return self._to_all_stages(hidden)

    def _logprobs(self, hidden: torch.Tensor, net: torch.nn.Module, packed: PackedTrees, **kw):
        """Log-probs (and with_entropy, entropies) of `packed`'s loss tokens from `net`'s LM head
        on `hidden` (T, H): vocab-parallel, the TP padding rows excluded (`vocab_size`)."""
        return packed_token_logprobs(
            hidden,
            output_weight(net),
            packed,
            tp_group=self.groups.pgs.tp,
            vocab_start=self._vocab_start(net),
            vocab_size=self.model_cfg.vocab_size,
            **kw,
        )

    @torch.no_grad()
    def probe(
        self, packed: PackedTrees, trees: Sequence[RolloutTree], tokenize: Callable[[str], list[int]], template: str
    ) -> torch.Tensor:
        """TRACE-C: (N,) ℓ̄ of the gold answer at the boundary after every node of `packed`, the layout
        of `trees`, from the frozen reference. Each data-parallel rank (with its TP and PP peers) probes its share
        of the trees (`balanced_bins` on tokens, the same on every rank); the last pipeline stage's
        values are broadcast over PP and the per-tree values all-gathered over DP, so no rank repeats
        another's forward."""
        if self.reference is None:
            raise RuntimeError("no reference model: TRACE-C needs credit.enabled at construction")
        g = self.groups
        share = list(range(len(trees)))
        if g.dp_size > 1:
            share = balanced_bins(packed.tree_num_tokens().tolist(), g.dp_size)[g.dp_rank]
        ell = (
            reference_probe(
                megatron_packed_forward(self.reference),
                [trees[i] for i in share],
                tokenize,
                template,
                output_weight=output_weight(self.reference),
                tp_group=g.pgs.tp,
                vocab_start=self._vocab_start(self.reference),
                max_tokens=self.cfg.parallel.micro_batch_tokens,
                max_answer_tokens=self.cfg.credit.max_answer_tokens,
                vocab_size=self.model_cfg.vocab_size,
            ).ell
            if share
            else []
        )
        if g.pp_size > 1 and ell:  # the stages before the last ran their layers; the values are the last's
            flat = self._to_all_stages(torch.cat(ell).to(g.device)).cpu()
            ell = list(flat.split([len(e) for e in ell]))
        result = ProbeResult(list(ell))
        if g.dp_size > 1:
            gathered: list = [None] * g.dp_size
            dist.all_gather_object(gathered, (share, [e.cpu() for e in ell]), group=g.pgs.dp)
            full: list = [None] * len(trees)
            for ids, values in gathered:
                for i, e in zip(ids, values):
                    full[i] = e
            result = ProbeResult(full)
        return result.for_packed(packed)

    @torch.no_grad()
    def score_nodes(
        self,
        packed: PackedTrees,
        nodes: torch.Tensor,
        score: NodeScorer,
        needs_hidden: bool,
        routing: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """(S,) float64 `score(sub, local, hidden)` of `nodes` (global ids of `packed`), on the learner's
        device and every rank: the TRACE-A predictor's scoring of prompts or prefixes.

        Split over DP ranks: each (with its TP and PP peers) encodes its share of the trees holding
        `nodes` (`balanced_bins` on tokens) and scores their nodes in the sub-layout `sub` (`local`:
        their ids there; `hidden`: `sub`'s policy hidden states when `needs_hidden`, replaying
        `routing`, the (T, L, k) engine routes of `packed`, if given); the sums over DP fill the vector."""
        g = self.groups
        out = torch.zeros(nodes.numel(), dtype=torch.float64, device=g.device)
        if nodes.numel() == 0:
            return out
        trees = sorted(set(packed.node_tree[nodes.cpu()].tolist()))
        tokens = packed.tree_num_tokens().tolist()
        share = [trees[j] for j in balanced_bins([tokens[t] for t in trees], g.dp_size)[g.dp_rank]]
        if share:
            sub = packed.select(share)
            idx, local = packed.nodes_in(share, nodes)
            sub_routing = None if routing is None else routing[packed.tree_tokens(share)]
            hidden = self.hidden_states(sub, sub_routing) if needs_hidden else None
            out[idx.to(g.device)] = score(sub, local, hidden).to(out)
        if g.dp_size > 1:
            dist.all_reduce(out, group=g.pgs.dp)
        return out

    # --- training ------------------------------------------------------------------
    @torch.no_grad()
    def old_logprobs(self, packed: PackedTrees, return_hidden: bool = False, routing: Optional[torch.Tensor] = None):
        """(T,) policy log-probs of `packed`'s loss tokens (no grad; on the last pipeline stage, None
        on the others), and with `return_hidden` the (T, H) final hidden states of every token they
        came from (on every rank).

        Pass the log-probs to `train_step(..., old_logprobs=...)` to reuse this forward as the PPO
        reference; the forward is chunked like `hidden_states` (and replays `routing` like it).
        """
        hidden = self.hidden_states(packed, routing)
        lp = self._logprobs(hidden, self.policy, packed) if self.groups.is_last_stage else None
        return (lp, hidden) if return_hidden else lp

    def _micro_batches(
        self, packed: PackedTrees, adv: "Advantages", tree_ids: Sequence[int]
    ) -> list[tuple[list[int], LossBatch, torch.Tensor]]:
        """This DP rank's micro-batches of the trees `tree_ids`: (trees, loss input, their stream positions
        in `packed`).

        The trees are binned by tokens into dp * n bins (`balanced_bins`, n = micro-batches per
        rank from the token budget, never more bins than trees: an empty one cannot run); rank r
        takes bins r::dp so every rank runs the same number of micro-batches. Advantages and token
        weights are sliced from `adv`; with `adv.pg_over_signal` the advantages are scaled by the unit count
        of all the trees `tree_ids` (the mini-batch, every rank's) over that of their trees with signal.
        """
        g = self.groups
        per_tree = packed.tree_num_tokens().tolist()
        sizes = [per_tree[i] for i in tree_ids]
        n = max(1, math.ceil(sum(sizes) / (g.dp_size * self.cfg.parallel.micro_batch_tokens)))
        n = min(n, max(1, len(tree_ids) // g.dp_size))
        scale = 1.0
        if adv.pg_over_signal:  # the same scale on every rank: it counts the whole mini-batch
            every = list(tree_ids)
            whole = adv.loss_batch(packed.select(every), packed.tree_tokens(every))
            scale = signal_scale(whole, aggregation_mode(self.cfg.loss))
        out = []
        for b in balanced_bins(sizes, g.dp_size * n)[g.dp_rank :: g.dp_size]:
            ids = [tree_ids[j] for j in b]
            idx = packed.tree_tokens(ids)
            lb = adv.loss_batch(packed.select(ids), idx)
            out.append((ids, lb if scale == 1.0 else dataclasses.replace(lb, advantages=lb.advantages * scale), idx))
        return out

    def train_step(
        self,
        packed: PackedTrees,
        advantages: Advantages,
        old_logprobs: Optional[torch.Tensor] = None,
        routing: Optional[torch.Tensor] = None,
    ) -> PolicyUpdate:
        """The step's policy update over the trees of `packed` with their `advantages`.

        `optim.epochs_per_step` passes over the step's mini-batches of whole trees
        (`_mini_batch_trees`), one optimiser step each; every DP rank takes part
        in every step (its share of each mini-batch), so the distributed optimizer's collectives
        line up. The PPO ratio is taken against `loss.old_logprobs`:
        * learner — the policy before the first update: `old_logprobs` (T,) when given (from
          `Learner.old_logprobs`), else one no-grad forward of each mini-batch before the first
          step. With one mini-batch and one epoch nothing is off-policy, so the current
          log-probs, detached, are the old ones (no extra forward; the update is the plain
          policy gradient, identical to a single on-policy step);
        * behaviour — the rollout engine's sampling log-probs stored on the trees.
        `loss.rollout_is` multiplies the surrogate by truncated weights min(π_old/π_engine, C),
        `loss.rollout_mask` / `rollout_reject` by 0 where that ratio or its divergence is extreme (`objective.mismatch`).
        Metrics are over all optimiser steps (unit-weighted means; ``*_max`` maxima). `routing`
        (T, L, k): the engine's MoE routes of `packed`, replayed by every policy forward here
        (`moe/*` metrics; with `model.moe_replay_probe` also the own-routing mismatch; docs/learner.md).

        Returns the metrics and the hidden states under the pre-update weights of the trees this
        DP rank trained on (its share of every mini-batch), in stream order, on every pipeline
        stage: the predictor fits on each rank's share (docs/step.md).
        """
        opt, lc, g = self.cfg.optim, self.cfg.loss, self.groups
        unit = aggregation_mode(lc)
        minis = [self._micro_batches(packed, advantages, ids) for ids in self._mini_batch_trees(packed, advantages)]
        # batch-normalised IS needs every micro-batch's old log-probs before the first one's loss
        single_update = len(minis) == 1 and opt.epochs_per_step == 1 and not lc.rollout_is_batch_normalize
        on_policy = lc.old_logprobs == "learner" and single_update
        # (T_share, H) hidden states of this rank's trees under the pre-update weights, for the
        # predictor: filled by the training forward of a single update, else by a no-grad forward.
        share = sorted(t for mini in minis for ids, _, _ in mini for t in ids)
        rows = packed.tree_tokens(share)  # ascending: trees are contiguous in tree order
        where = torch.full((packed.num_tokens,), -1, dtype=torch.long)
        where[rows] = torch.arange(rows.numel())
        hidden = torch.zeros(rows.numel(), self.hidden_size, device=g.device, dtype=self.dtype)
        plans = [self._prepare(mini, hidden, where, old_logprobs, single_update, routing) for mini in minis]
        if lc.rollout_is_batch_normalize and g.is_last_stage:
            self._normalise_is([b for batches in plans for b in batches])
        loss_fn = self._loss_fn(unit, on_policy)
        steps = [
            train_step(self.chunks, self.optimizer, self.scheduler, batches, loss_fn, g, output="hidden")
            for _ in range(opt.epochs_per_step)
            for batches in plans
        ]
        metrics = update_metrics(steps)
        if self.replays_routes:
            metrics |= take_metrics([self.policy], self.model_cfg.num_layers, g.device)
        return PolicyUpdate(metrics, self._to_all_stages(hidden), share)

    def _mini_batch_trees(self, packed: PackedTrees, advantages: Advantages) -> list[list[int]]:
        """The step's trees in mini-batches: `optim.mini_batches_per_step` balanced by tokens, or with
        `optim.contrasted_trees_per_mini_batch` one per that many contrasted trees (a tree with a
        nonzero advantage on some token), each holding its share of them. At most one mini-batch per
        dp_size trees: every rank needs a tree in every mini-batch."""
        opt, most = self.cfg.optim, max(1, packed.num_trees // self.groups.dp_size)
        sizes = packed.tree_num_tokens()
        if opt.contrasted_trees_per_mini_batch == 0:
            return balanced_bins(sizes.tolist(), min(opt.mini_batches_per_step, most))
        owner = torch.repeat_interleave(torch.arange(packed.num_trees), sizes)  # (T,) tree of each token
        signal = torch.zeros(packed.num_trees).index_add_(0, owner, advantages.advantages.abs().cpu().float())
        return contrast_bins(sizes.tolist(), (signal > 0).tolist(), opt.contrasted_trees_per_mini_batch, most)

    @torch.no_grad()
    def _prepare(
        self,
        mini: list,
        hidden: torch.Tensor,
        where: torch.Tensor,
        old_logprobs: Optional[torch.Tensor],
        single_update: bool,
        routing: Optional[torch.Tensor],
    ) -> list[dict]:
        """The micro-batches of one mini-batch, prepared before any update: inputs, the reference's
        log-probs (KL), and unless the update is a single one the no-grad forward under the
        pre-update weights (the hidden rows now or never; the old log-probs). Log-probs live on the
        last pipeline stage, where the loss runs."""
        lc, g = self.cfg.loss, self.groups
        batches = [
            dict(
                self._batch(lb.packed, routing=None if routing is None else routing[idx]),
                loss=lb,
                hidden_out=(hidden, where[idx].to(g.device)),
            )
            for _, lb, idx in mini
        ]
        if self.reference is not None and lc.kl_coef > 0:
            for b, h in zip(batches, forward_only(self.reference, batches)):
                mb = b["loss"].packed
                b["ref_logprobs"] = self._logprobs(h[0, : mb.num_tokens], self.reference, mb)
        if routing is not None and self.cfg.model.moe_replay_probe:  # the same tokens, routed on their own
            for b, h in zip(batches, forward_only(self.chunks[0], [dict(b, routing=None) for b in batches])):
                mb = b["loss"].packed
                b["own_routing_logprobs"] = self._logprobs(h[0, : mb.num_tokens], self.policy, mb)
        if single_update:  # the training forward fills the hidden rows and is its own old policy
            return batches
        for b, h in zip(batches, forward_only(self.chunks[0], batches)):
            out, at = b["hidden_out"]
            h = h[0, : b["loss"].packed.num_tokens]
            out[at] = h.to(out.dtype)
            if lc.old_logprobs == "learner" and old_logprobs is None:
                b["old_logprobs"] = self._logprobs(h, self.policy, b["loss"].packed)
        for b, (_, _, idx) in zip(batches, mini):
            del b["hidden_out"]
            if lc.old_logprobs == "learner" and old_logprobs is not None and g.is_last_stage:
                b["old_logprobs"] = old_logprobs[idx.to(old_logprobs.device)]
        return batches

    def _normalise_is(self, batches: list[dict]) -> None:
        """Sets each micro-batch's `is_norm`: the mean rollout IS weight of the step's whole batch (every
        mini-batch, this stage's DP ranks; `losses.rollout_is_weights`' is_norm sums), which its loss divides
        the weights by. verl's trainer normalises the whole batch too, before splitting it into mini-batches."""
        lc, g = self.cfg.loss, self.groups
        total = torch.zeros(2, dtype=torch.float64, device=g.device)
        for b in batches:
            lb = b["loss"]
            _, m = correction_weights(b["old_logprobs"], lb.packed.behaviour_logprobs, lb, lc)
            total += torch.stack([m["is_norm_sum"], m["is_norm_count"]]).to(total)
        if g.dp_size > 1:
            dist.all_reduce(total, group=g.pgs.dp_cp)
        mean = float(total[0] / total[1].clamp(min=1))
        for b in batches:
            b["is_norm"] = mean if mean > 1e-8 else 1.0  # verl keeps the raw weights below 1e-8

    def _loss_fn(self, unit: str, on_policy: bool):
        cfg = self.cfg.loss
        if cfg.aggregation == "seq_mean_token_sum_norm" and cfg.seq_norm_tokens is None:
            cfg = dataclasses.replace(cfg, seq_norm_tokens=self.cfg.rollout.max_total_tokens)

        def loss_fn(hidden: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
            lb: LossBatch = batch["loss"]
            mb = lb.packed
            h = hidden[0, : mb.num_tokens]  # (T, H)
            if "hidden_out" in batch:  # a single update: its forward runs under the pre-update weights
                out_hidden, idx = batch["hidden_out"]
                out_hidden[idx] = h.detach().to(out_hidden.dtype)
            # Under sequence parallelism the model's hidden-state gather already sums the
            # hidden gradient over TP in its backward; the kernel must not sum it again.
            lp, ent = self._logprobs(
                h, self.chunks[0], mb, with_entropy=True, reduce_grad_hidden=not self.policy.config.sequence_parallel
            )
            behaviour = mb.behaviour_logprobs.to(lp)
            old = (lp.detach() if on_policy else batch["old_logprobs"]) if cfg.old_logprobs == "learner" else behaviour
            mask = mb.loss_mask.to(lp.device)
            # engine-vs-learner mismatch at the rollout weights (the current ones when on-policy),
            # and the rollout correction's weights (truncated IS, extreme-ratio mask)
            learner_lp = lp.detach() if cfg.old_logprobs == "behaviour" else old
            is_w, metrics = rollout_correction(old, behaviour, learner_lp, lb, cfg)
            if "is_norm" in batch:  # verl's rollout_is_batch_normalize (`_normalise_is`)
                is_w = is_w / batch["is_norm"]
                metrics["rollout_is_mean_tok_sum"] = metrics["rollout_is_mean_tok_sum"] / batch["is_norm"]
                metrics["rollout_is_max"] = metrics["rollout_is_max"] / batch["is_norm"]
                metrics["rollout_is_norm_factor_tok_sum"] = batch["is_norm"] * mask.sum().float()
            out = compute_loss(
                lp, lb, cfg, old_logprobs=old, ref_logprobs=batch.get("ref_logprobs"), entropy=ent, is_weights=is_w
            )
            units = unit_count(lb, unit).to(lp)
            for k, v in out.metrics.items():  # unit-weighted sums (maxima stay maxima)
                metrics[k if k.endswith("_max") else f"{k}_sum"] = v.detach().float() * (
                    1 if k.endswith("_max") else units
                )
            metrics["entropy_tok_sum"] = (ent.detach() * mask).sum()
            metrics["mask_tokens"] = mask.sum().float()
            if "own_routing_logprobs" in batch:  # the replay probe (`_prepare`)
                metrics |= own_routing_sums(batch["own_routing_logprobs"], behaviour, mask)
            return out.loss * units, units, metrics

        return loss_fn

    # --- weights and checkpoints -----------------------------------------------------
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of the whole policy (collective: every rank must iterate).

        Each stage's tensors are gathered over TP/EP; with pipeline stages they are then
        broadcast over PP stage by stage, one tensor at a time, since a rollout replica spans
        every stage of its model-parallel group and its engine loads the whole network."""
        if self.groups.pp_size == 1:
            return export_hf(self.chunks[0], self.groups)
        return self._export_all_stages()

    def _export_all_stages(self) -> Iterator[tuple[str, torch.Tensor]]:
        g = self.groups
        for stage in range(g.pp_size):
            src = dist.get_global_rank(g.pgs.pp, stage)
            sender = stage == g.pp_rank
            mine = iter(export_hf(self.chunks[0], g)) if sender else None
            while True:
                meta: list = [None]  # (name, shape, dtype) of the sender's next tensor, or "end"
                if sender:
                    item = next(mine, None)
                    meta = ["end" if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
                dist.broadcast_object_list(meta, src=src, group=g.pgs.pp)
                if meta[0] == "end":
                    break
                name, shape, dtype = meta[0]
                t = item[1].contiguous() if sender else torch.empty(shape, dtype=dtype, device=g.device)
                dist.broadcast(t, src=src, group=g.pgs.pp)
                yield name, t

    def sync_weights(self, engine: Optional["Engine"]) -> None:
        """Push the policy's weights into `engine` in memory. Every rank calls this (the export is
        collective); a rank without an engine (None) runs the export and drops the tensors."""
        weights = self.export_weights()
        if engine is not None:
            engine.update_weights(weights)
        else:
            for _ in weights:
                pass

    def save_hf(self, out_dir: str | Path) -> Path:
        """Write the policy as an HF checkpoint (safetensors + config.json); collective."""
        save_hf(self.chunks[0], self.groups, out_dir, policy_hf_config(self.cfg, self.model_cfg))
        return Path(out_dir)

    def save(
        self,
        root: str | Path,
        step: int,
        trainer_state: dict[str, Any],
        extras: Optional[dict[str, Callable[[Path], None]]] = None,
        keep_last: int = 0,
        keep_every: Optional[int] = None,
        rank_state: Any = None,
    ) -> Path:
        """Checkpoint at `step` (collective; `checkpoint.save_checkpoint`): `extras` are files rank 0
        writes beside it, `rank_state` this rank's own state, then older checkpoints beyond `keep_last`
        (milestones every `keep_every` steps excepted) are removed. A failed write raises
        `CheckpointError`; `latest` is untouched."""
        state = (self.chunks, self.optimizer, self.scheduler, self.groups, trainer_state)
        return save_checkpoint(
            root, step, *state, extras=extras, keep_last=keep_last, keep_every=keep_every, rank_state=rank_state
        )

    def load_latest(self, root: str | Path) -> Optional[dict[str, Any]]:
        """Restore the newest intact checkpoint under `root` (a damaged newer one is skipped with a
        warning); returns its trainer state, or None if there is none. `CheckpointError` when there
        are checkpoints but none is intact. Collective: rank 0 picks the checkpoint for all."""
        path = latest_checkpoint(root, self.groups)
        if path is None:
            return None
        return load_checkpoint(path, self.chunks, self.optimizer, self.scheduler, self.groups)
