"""`Learner`: the trainer's one view of the Megatron-Core policy and its frozen reference.

It owns the parallel state, the policy (megatron DDP + optimizer + LR
schedule), the frozen reference (a copy of the initial policy, built only when
the KL term or TRACE-C needs it), and exposes what the step loop needs:

* `encode(batch)` — policy final hidden states of a step's layout, for the
  predictor's value head (one forward, no grad), once per layout;
* `probe(batch, tokenize, template)` — TRACE-C's ℓ̄ at every tool boundary from
  the reference (one packed forward per group of trees);
* `train_step(batch)` — one optimiser step on packed micro-batches of whole
  trees with `batch.advantages`; it leaves the training forward's detached
  hidden states (the step's pre-update weights) in `batch.hidden`, so the
  predictor fits without another policy forward (docs/step.md);
* `sync_weights(engine)` — the in-memory weight sync to a rollout engine (the
  collective HF-named export runs on every rank); `save` / `load` — megatron
  dist checkpoints.

Micro-batches hold whole trees (so every group-relative quantity is local to
one micro-batch) and are split over data-parallel ranks; each is padded to a
multiple of the TP size with one padding node that attends only to itself and
carries no loss. One policy update per batch of rollouts (on-policy): the PPO
ratio is taken against the learner's own detached log-probs, so it is 1 in
value and its gradient is the policy gradient; the engine's behaviour
log-probs stay on the tree and their mismatch with the learner's is logged.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from trace_mega.config import TrainConfig
from trace_mega.learner.attention import tree_attention_mask
from trace_mega.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trace_mega.learner.convert import export_hf, load_hf_into, save_hf
from trace_mega.learner.logprobs import packed_token_logprobs
from trace_mega.learner.losses import aggregation_mode, compute_loss, unit_count
from trace_mega.learner.models import build_model, forward_packed, model_config_from_hf, output_weight, unwrap
from trace_mega.learner.optim import build_optimizer, train_step, wrap_ddp
from trace_mega.learner.parallel import ParallelGroups, init_parallel
from trace_mega.learner.probe import megatron_packed_forward, reference_probe
from trace_mega.rollout.tree import PackedTrees

if TYPE_CHECKING:
    from trace_mega.learner.advantages import Advantages
    from trace_mega.rollout.engines import Engine
    from trace_mega.step import StepBatch

def resolve_model_config(cfg: TrainConfig):
    """The `ModelConfig` in force: from the HF checkpoint's config.json when one is given."""
    if cfg.model.hf_checkpoint is None:
        return cfg.model
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model.hf_checkpoint)
    return model_config_from_hf(hf, params_dtype=cfg.model.params_dtype, attention_backend=cfg.model.attention_backend)


def hf_config(model_cfg) -> Any:
    """A transformers config describing the same network (the rollout engines' view of the policy)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size, num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads, num_key_value_heads=model_cfg.num_query_groups,
        head_dim=model_cfg.head_dim, max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.norm_epsilon, tie_word_embeddings=model_cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(model_cfg.rotary_base)},
        attention_bias=False, torch_dtype="float32",
    )
    if not model_cfg.qk_layernorm:
        raise ValueError("the rollout engines' HF view is Qwen3 (q/k-norm); set model.qk_layernorm: true")
    if model_cfg.num_experts:
        return Qwen3MoeConfig(num_experts=model_cfg.num_experts, num_experts_per_tok=model_cfg.moe_router_topk,
                              moe_intermediate_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
                              norm_topk_prob=True, **common)
    return Qwen3Config(**common)


def policy_hf_config(cfg: TrainConfig, model_cfg) -> Any:
    """The transformers config an export of the policy carries: the source checkpoint's own
    config (its architecture and extra fields) when initialised from one, else `hf_config`'s
    Qwen3 / Qwen3-MoE view; `architectures` and `dtype` set for loaders (transformers, vLLM)."""
    if cfg.model.hf_checkpoint:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model.hf_checkpoint)
    else:
        config = hf_config(model_cfg)
        config.architectures = ["Qwen3MoeForCausalLM" if model_cfg.num_experts else "Qwen3ForCausalLM"]
    config.dtype = model_cfg.params_dtype
    return config


class Learner:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.groups: ParallelGroups = init_parallel(cfg.parallel, seed=cfg.seed)
        g = self.groups
        self.model_cfg = resolve_model_config(cfg)
        if g.pp_size > 1:
            raise ValueError("parallel.pipeline_model_parallel_size > 1: the trainer's predictor / probe passes "
                             "run on PP = 1 (the learner's train_step itself supports PP; see docs/learner.md)")
        policy = build_model(self.model_cfg, cfg.parallel, g.pgs, g.device, g.pp_rank, g.pp_size)
        if cfg.model.hf_checkpoint:
            load_hf_into(policy, cfg.model.hf_checkpoint, g)
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

    def _lm_head(self, net: torch.nn.Module) -> tuple[torch.Tensor, int]:
        """This TP rank's LM-head rows of real tokens and the vocab id of its first row.

        The vocabulary is padded to a multiple of the TP size; the padding rows are cut
        off (a view, so gradients still reach the weight), so that every log-softmax
        normalises over the true vocabulary only, as the HF model and the engines do.
        """
        weight = output_weight(net)  # (V_padded / tp, H)
        start = self.groups.tp_rank * weight.shape[0]
        real = max(0, min(weight.shape[0], unwrap(net).true_vocab_size - start))
        return weight[:real], start

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

    @torch.no_grad()
    def hidden_states(self, packed: PackedTrees) -> torch.Tensor:
        """(T, H) policy hidden states after the final norm (no grad), one forward per run of
        consecutive trees holding at most `parallel.micro_batch_tokens` tokens."""
        if packed.num_tokens == 0:
            return torch.zeros(0, self.hidden_size, device=self.groups.device)
        starts = packed.node_start[packed.tree_node_offset[:-1]].tolist() + [packed.num_tokens]
        out, first = [], 0
        for i in range(packed.num_trees):
            if i + 1 == packed.num_trees or starts[i + 2] - starts[first] > self.cfg.parallel.micro_batch_tokens:
                ids, pos, mask = self._inputs(packed, slice(first, i + 1))
                hidden = forward_packed(self.policy, ids, pos, mask, output="hidden")[0]
                out.append(hidden[: starts[i + 1] - starts[first]])
                first = i + 1
        return torch.cat(out)

    def encode(self, batch: "StepBatch") -> torch.Tensor:
        """`batch.hidden`: the policy's hidden states of the step's current layout (no grad),
        computed only when no forward under the current weights has produced them yet."""
        if batch.hidden is None:
            batch.hidden = self.hidden_states(batch.packed)
        return batch.hidden

    @torch.no_grad()
    def token_logprobs(self, packed: PackedTrees, model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        """(T,) log-probs of `packed`'s loss-mask tokens under `model` (default: the policy), 0 elsewhere."""
        net = self.policy if model is None else model
        ids, pos, mask = self._inputs(packed)
        hidden = forward_packed(net, ids, pos, mask, output="hidden")[0, : packed.num_tokens]
        weight, start = self._lm_head(net)
        return packed_token_logprobs(hidden, weight, packed, tp_group=self.groups.pgs.tp, vocab_start=start)

    @torch.no_grad()
    def probe(self, batch: "StepBatch", tokenize: Callable[[str], list[int]], template: str) -> torch.Tensor:
        """TRACE-C: (N,) ℓ̄ of the gold answer at the boundary after every node of the step's layout,
        from the frozen reference."""
        if self.reference is None:
            raise RuntimeError("no reference model: TRACE-C needs credit.enabled at construction")
        weight, start = self._lm_head(self.reference)
        return reference_probe(
            megatron_packed_forward(self.reference), batch.trees, tokenize, template,
            output_weight=weight, tp_group=self.groups.pgs.tp,
            vocab_start=start, max_tokens=self.cfg.parallel.micro_batch_tokens,
            max_answer_tokens=self.cfg.credit.max_answer_tokens,
        ).for_packed(batch.packed)

    # --- training ------------------------------------------------------------------
    def _micro_batches(self, packed: PackedTrees, adv: "Advantages") -> list[tuple[PackedTrees, torch.Tensor]]:
        """This DP rank's micro-batches of whole trees cut from `packed`, each with its stream
        indices in `packed` (T_mb,) and the slice of `adv` it trains on.

        Trees are placed largest first into dp * n bins (n = micro-batches per
        rank, from the token budget) by least load; rank r takes bins r::dp so
        every rank runs the same number of micro-batches.
        """
        g = self.groups
        node_off = packed.tree_node_offset
        start = packed.node_start[node_off[:-1]]
        end = torch.cat([start[1:], torch.tensor([packed.num_tokens])])
        sizes = (end - start).tolist()
        n = max(1, math.ceil(sum(sizes) / (g.dp_size * self.cfg.parallel.micro_batch_tokens)))
        n = min(n, max(1, packed.num_trees // g.dp_size))  # never more bins than trees: an empty one cannot run
        bins: list[list[int]] = [[] for _ in range(g.dp_size * n)]
        load = [0] * len(bins)
        for i in sorted(range(packed.num_trees), key=lambda i: -sizes[i]):
            b = min(range(len(bins)), key=lambda b: load[b])
            bins[b].append(i)
            load[b] += sizes[i]
        out = []
        for b in bins[g.dp_rank:: g.dp_size]:
            b.sort()
            mb, idx = packed.select(b), packed.tree_tokens(b)
            # The loss reads its per-token inputs off the micro-batch it is given.
            mb.advantages, mb.token_weight = adv.advantages[idx], adv.token_weight[idx]
            out.append((mb, idx))
        return out

    def train_step(self, step: "StepBatch") -> dict[str, float]:
        """One optimiser step over the step's trees with `step.advantages`; sets `step.hidden`."""
        if step.advantages is None:
            raise ValueError("run an advantage estimator on the step first (StepBatch.advantages)")
        packed = step.packed
        unit = aggregation_mode(self.cfg.loss)
        # (T, H) hidden states of the whole layout, filled by the loss of every micro-batch.
        hidden = torch.zeros(packed.num_tokens, self.hidden_size, device=self.groups.device,
                             dtype=getattr(torch, self.model_cfg.params_dtype))
        batches = []
        for mb, idx in self._micro_batches(packed, step.advantages):
            ids, pos, mask = self._inputs(mb)
            batch = {"input_ids": ids, "position_ids": pos, "tree_mask": mask, "packed": mb,
                     "hidden_out": (hidden, idx.to(hidden.device))}
            if self.reference is not None and self.cfg.loss.kl_coef > 0:
                batch["ref_logprobs"] = self.token_logprobs(mb, self.reference)
            batches.append(batch)
        raw = train_step(self.chunks, self.optimizer, self.scheduler, batches, self._loss_fn(unit),
                         self.groups, output="hidden")
        step.hidden = self._share_hidden(hidden)
        units = max(raw.pop("num_tokens"), 1e-12)
        out = {"loss/total": raw.pop("loss_sum") / units, "loss/grad_norm": raw.pop("grad_norm"),
               "loss/lr": raw.pop("lr"), "loss/skipped": raw.pop("skipped"), "loss/units": units}
        raw.pop("loss", None)
        mask_tokens = max(raw.pop("mask_tokens"), 1.0)
        out["loss/logprob_mismatch"] = raw.pop("mismatch_sum") / mask_tokens
        out["loss/token_entropy"] = raw.pop("entropy_tok_sum") / mask_tokens
        for k, v in raw.items():  # unit-weighted sums of the loss metrics
            out[f"loss/{k.removesuffix('_sum')}"] = v / units
        return out

    def _share_hidden(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The training forward's hidden states of the whole layout on every rank: each DP rank
        filled the rows of its own micro-batches (the others are 0, so the sum is exact); TP ranks
        hold the same rows. None with pipeline stages (only the last one ran the loss)."""
        if self.groups.pp_size > 1:
            return None
        if self.groups.dp_size > 1:
            dist.all_reduce(hidden, group=self.groups.pgs.dp_cp)
        return hidden

    def _loss_fn(self, unit: str):
        cfg, g = self.cfg.loss, self.groups

        def loss_fn(hidden: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
            mb: PackedTrees = batch["packed"]
            h = hidden[0, : mb.num_tokens]  # (T, H)
            # Detached copy for the predictor: the step's hidden states under the pre-update weights.
            out_hidden, idx = batch["hidden_out"]
            out_hidden[idx] = h.detach().to(out_hidden.dtype)
            # Under sequence parallelism the model's hidden-state gather already sums the
            # hidden gradient over TP in its backward; the kernel must not sum it again.
            weight, start = self._lm_head(self.chunks[0])
            lp, ent = packed_token_logprobs(h, weight, mb, tp_group=g.pgs.tp, vocab_start=start, with_entropy=True,
                                            reduce_grad_hidden=not self.policy.config.sequence_parallel)
            out = compute_loss(lp, mb, cfg, old_logprobs=lp.detach(), ref_logprobs=batch.get("ref_logprobs"),
                               entropy=ent)
            units = unit_count(mb, unit).to(lp)
            mask = mb.loss_mask.to(lp.device)
            metrics = {f"{k}_sum": v.detach().float() * units for k, v in out.metrics.items()}
            metrics["mismatch_sum"] = ((lp.detach() - mb.behaviour_logprobs.to(lp)).abs() * mask).sum()
            metrics["entropy_tok_sum"] = (ent.detach() * mask).sum()
            metrics["mask_tokens"] = mask.sum().float()
            return out.loss * units, units, metrics

        return loss_fn

    # --- weights and checkpoints -----------------------------------------------------
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of the policy (collective over TP/EP: every rank must iterate)."""
        return export_hf(self.chunks[0], self.groups)

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

    def save(self, root: str | Path, step: int, trainer_state: dict[str, Any]) -> Path:
        return save_checkpoint(root, step, self.chunks, self.optimizer, self.scheduler, self.groups, trainer_state)

    def load_latest(self, root: str | Path) -> Optional[dict[str, Any]]:
        """Restore the newest checkpoint under `root`; returns its trainer state, or None if there is none."""
        path = latest_checkpoint(root) if Path(root).exists() else None
        if path is None:
            return None
        return load_checkpoint(path, self.chunks, self.optimizer, self.scheduler, self.groups)
