"""Optimiser and training step on megatron-core: DDP, (distributed) Adam, clipping, NaN guard.

* `wrap_ddp(net, parallel_cfg)`: megatron `DistributedDataParallel` (grad
  buffers; the distributed optimizer shards over DP when `use_distributed_optimizer`).
* `build_optimizer(chunks, optim_cfg, parallel_cfg, groups)`: megatron's
  `get_megatron_optimizer` + `OptimizerParamScheduler` (linear warm-up, then
  constant or cosine to `min_lr`).
* `train_step(chunks, optimizer, scheduler, batches, loss_fn, groups)`: one
  optimiser step over a list of micro-batches through `get_forward_backward_func`
  (1F1B with PP). The model output handed to `loss_fn` is vocab-parallel logits
  `(B, T, V/tp)` (or hidden states `(B, T, H)` with `output="hidden"`).
* `forward_only(model, batches)`: the no-grad forward of a list of micro-batches
  through the same schedule (pipelined over PP stages); the final hidden states
  come back on the last stage.

Loss contract: `loss_fn(output, batch) -> (loss_sum, num_tokens, metrics)`:
`loss_sum` a scalar summed over this micro-batch's tokens, `num_tokens` an int
tensor; the gradient is that of `sum(loss_sum) / sum(num_tokens)` over all
micro-batches and data-parallel ranks (megatron's per-token loss mode).

NaN/inf guard: when the loss or the global gradient norm is not finite the
update is skipped on every rank (gradients dropped, weights untouched) and the
returned metrics say `skipped=1.0`.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Callable, Iterable, Literal, Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from trace_mega.config import OptimConfig, ParallelConfig
from trace_mega.learner.models import unwrap
from trace_mega.learner.parallel import ParallelGroups
from trace_mega.learner.routing_replay import own_routing_metrics
from trace_mega.objective.mismatch import mismatch_metrics
from trace_mega.ops.attention import tree_attention_mask

__all__ = ["wrap_ddp", "build_optimizer", "train_step", "forward_only", "megatron_packed_forward", "LossFn"]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]"]


def wrap_ddp(net: torch.nn.Module, parallel: ParallelConfig, groups: ParallelGroups) -> DistributedDataParallel:
    """Megatron DDP around one model chunk, with fp32 grad buffers."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer and groups.dp_size > 1,
    )
    return DistributedDataParallel(config=net.config, ddp_config=ddp_config, module=net, pg_collection=groups.pgs)


def build_optimizer(
    chunks: list[DistributedDataParallel],
    optim: OptimConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """megatron Adam (distributed over DP when configured) + LR schedule; wires the model config."""
    model_config = chunks[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad_norm,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=chunks[0].ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks, use_gloo_process_groups=False, pg_collection=groups.pgs)
    # The schedule helpers read these from the model config.
    model_config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=groups.pgs)
    model_config.no_sync_func = chunks[0].no_sync
    model_config.grad_scale_func = optimizer.scale_loss
    decay = optim.lr_decay_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(decay, optim.warmup_steps + 1),
        lr_decay_style="cosine" if decay > 0 else "constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _forward_step(loss_fn: LossFn, output: str, data_iterator, model):
    """megatron `forward_step_func`: run one micro-batch, return (output, loss closure)."""
    batch = next(data_iterator)
    out = model(
        batch["input_ids"],
        batch["position_ids"],
        batch.get("tree_mask"),
        return_hidden=output == "hidden",
        routing=batch.get("routing"),
    )
    return out, partial(_loss_closure, loss_fn, output, batch)


def _loss_closure(loss_fn: LossFn, output: str, batch: dict, out: torch.Tensor):
    if output == "hidden":
        out = out.transpose(0, 1)  # (S, B, H) -> (B, S, H)
    loss_sum, num_tokens, metrics = loss_fn(out, batch)
    reported = {"loss_sum": loss_sum.detach().float(), "num_tokens": num_tokens.detach().float()}
    reported.update({k: v.detach().float() for k, v in metrics.items()})
    return loss_sum, num_tokens.to(torch.int), reported


_SUM_KEYS = ("loss_sum", "num_tokens", "mask_tokens")


def update_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of one trainer step from its optimiser steps' reduced metrics.

    Sums (``*_sum`` over units, ``*_tok_sum`` over loss tokens) are added up over the steps and
    normalised once; maxima are maxima; grad_norm is the mean, lr the last, skipped the count.
    """
    total: dict[str, float] = {}
    for raw in steps:
        for k, v in raw.items():
            if k.endswith("_max"):
                total[k] = max(total.get(k, -math.inf), v)
            elif k.endswith("_sum") or k in _SUM_KEYS:
                total[k] = total.get(k, 0.0) + v
    units = max(total.pop("num_tokens"), 1e-12)
    tokens = max(total.pop("mask_tokens"), 1.0)
    out = {
        "loss/total": total.pop("loss_sum") / units,
        "loss/units": units,
        "loss/grad_norm": sum(r["grad_norm"] for r in steps) / len(steps),
        "loss/lr": steps[-1]["lr"],
        "loss/skipped": sum(r["skipped"] for r in steps),
        "loss/optimizer_steps": float(len(steps)),
    }
    out.update(mismatch_metrics(total))  # mismatch/* and loss/logprob_mismatch, over the finite loss tokens
    out.update(own_routing_metrics(total))  # moe/own_routing_*: the replay probe, when it ran
    out["loss/token_entropy"] = total.pop("entropy_tok_sum") / tokens
    for k, v in total.items():
        if k.endswith("_tok_sum"):
            out[f"loss/{k.removesuffix('_tok_sum')}"] = v / tokens
        elif k.endswith("_sum"):
            out[f"loss/{k.removesuffix('_sum')}"] = v / units
        else:
            out[f"loss/{k}"] = v
    return out


def _optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _reduce_metrics(stored: list[dict], groups: ParallelGroups, device: torch.device) -> dict[str, float]:
    """Sum micro-batch metrics (keys ending in ``_max``: take the max), over DP on the last stage,
    then share them with every PP stage."""
    last = dist.get_global_rank(groups.pgs.pp, groups.pp_size - 1)
    keys = [sorted(stored[0]) if stored else []]
    if groups.pp_size > 1:  # only the last stage ran the loss
        dist.broadcast_object_list(keys, src=last, group=groups.pgs.pp)
    out = {}
    for is_max in (False, True):
        ks = [k for k in keys[0] if k.endswith("_max") == is_max]
        vals = torch.zeros(len(ks), device=device)
        for i, k in enumerate(ks):
            if stored:
                vals[i] = max(m[k] for m in stored) if is_max else sum(m[k] for m in stored)
        if groups.is_last_stage and groups.dp_size > 1 and ks:
            dist.all_reduce(vals, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=groups.pgs.dp_cp)
        if groups.pp_size > 1 and ks:
            dist.broadcast(vals, src=last, group=groups.pgs.pp)
        out.update(zip(ks, vals.tolist()))
    return out


def train_step(
    chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    scheduler: Optional[OptimizerParamScheduler],
    batches: Iterable[dict],
    loss_fn: LossFn,
    groups: ParallelGroups,
    output: Literal["logits", "hidden"] = "logits",
) -> dict[str, float]:
    """One optimiser step over this DP rank's micro-batches (same count on every DP rank).

    Each batch: `input_ids`, `position_ids` `(B, T)`, optional `tree_mask` `(2, B, T)` and
    `routing` `(B, T, L, k)` (MoE routes to replay, `routing_replay`), plus whatever `loss_fn` reads. Returns summed `loss_sum`, `num_tokens` and
    loss_fn metrics (over micro-batches and DP), `loss` = loss_sum / num_tokens,
    `grad_norm`, `lr`, `skipped` (1.0 when the NaN/inf guard dropped the update).
    """
    batches = list(batches)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    seq_length = max(b["input_ids"].shape[1] for b in batches)
    stored = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_fn, output),
        data_iterator=iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=batches[0]["input_ids"].shape[0],
        forward_only=False,
    )
    metrics = _reduce_metrics(stored, groups, groups.device)
    metrics["loss"] = metrics["loss_sum"] / max(metrics["num_tokens"], 1.0)

    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm) or not math.isfinite(metrics["loss"]):
        # Never apply a non-finite update: drop this step's gradients everywhere
        # (the grad norm and loss are identical on all ranks, so all ranks agree).
        log.warning("train_step: non-finite loss %s / grad norm %s, update skipped", metrics["loss"], grad_norm)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        metrics.update(grad_norm=grad_norm, skipped=1.0, lr=_lr(optimizer))
        return metrics
    clip = optimizer.config.clip_grad
    for opt in _optimizers(optimizer):
        params = opt.get_parameters()
        if clip > 0 and params:
            clip_grad_by_total_norm_fp32(
                params, clip, grad_norm, opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            )
    optimizer.step_with_ready_grads()
    lr = _lr(optimizer)
    if scheduler is not None:
        scheduler.step(increment=1)
    metrics.update(grad_norm=grad_norm, skipped=0.0, lr=lr)
    return metrics


def _forward_only_step(data_iterator, model):
    """megatron `forward_step_func` without a loss: the last stage's schedule keeps the output."""
    batch = next(data_iterator)
    out = model(
        batch["input_ids"],
        batch["position_ids"],
        batch.get("tree_mask"),
        return_hidden=True,
        routing=batch.get("routing"),
    )
    return out, None


@torch.no_grad()
def forward_only(model: torch.nn.Module, batches: Iterable[dict]) -> list[torch.Tensor]:
    """(B, T, H) final-norm hidden states of each micro-batch (no grad), in order, on the model's
    last pipeline stage; [] on the other stages (their layers ran, their output went downstream).

    Runs megatron's schedule with `forward_only=True`, so with PP the micro-batches flow through
    the stages as in training (shapes exchanged per micro-batch: `variable_seq_lengths`); every
    rank of the model-parallel group must call it with the same batches. `model` is a policy
    chunk (DDP-wrapped) or the frozen reference.
    """
    batches = list(batches)
    if not batches:
        return []
    out = get_forward_backward_func()(
        forward_step_func=_forward_only_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(b["input_ids"].shape[1] for b in batches),
        micro_batch_size=batches[0]["input_ids"].shape[0],
        forward_only=True,
    )
    return [h.transpose(0, 1) for h in out]  # (S, B, H) -> (B, S, H); empty before the last stage


def _lr(optimizer: MegatronOptimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def megatron_packed_forward(
    model: torch.nn.Module, pad_multiple: Optional[int] = None
) -> Callable[..., Optional[torch.Tensor]]:
    """`trace_mega.credit.probe.PackedForward` (hidden states) for the learner's `TreeGPTModel`; pair with
    `trace_mega.learner.models.output_weight(model)`.

    Inputs move to the model's device; the stream is padded to a multiple of `pad_multiple`
    (default: the TP size, as sequence parallelism splits it) with one extra node that
    attends only to itself. The forward runs through megatron's schedule (`forward_only`), so
    with pipeline stages every stage calls it and only the last gets the hidden states (None on
    the others).
    """
    net = unwrap(model)
    multiple = pad_multiple or net.config.tensor_model_parallel_size

    def forward(tokens, position_ids, token_node, token_node_exit):
        dev = next(net.parameters()).device
        T = tokens.shape[1]
        pad = (-T) % multiple
        if pad:
            extra = int(token_node.max()) + 1  # a node after every real node: sees only itself
            fill = lambda x, v: torch.cat([x, x.new_full((1, pad), v)], dim=1)  # noqa: E731
            tokens, token_node, token_node_exit = fill(tokens, 0), fill(token_node, extra), fill(token_node_exit, extra)
            position_ids = torch.cat([position_ids, torch.arange(pad)[None]], dim=1)
        mask = tree_attention_mask(token_node.to(dev), token_node_exit.to(dev))
        out = forward_only(
            model, [{"input_ids": tokens.to(dev), "position_ids": position_ids.to(dev), "tree_mask": mask}]
        )
        return out[0][0, :T] if out else None  # (T, H)

    return forward
