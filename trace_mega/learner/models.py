"""Megatron-Core GPT / MoE models from `ModelConfig`, with a packed-tree forward.

* `transformer_config(model_cfg, parallel_cfg, device)` -> megatron `TransformerConfig`
  for the Qwen2 / Qwen3 / Llama family (RMSNorm, SwiGLU, RoPE, GQA, optional
  q/k-norm and QKV bias) and Qwen3-MoE (top-k softmax router, no bias, EP).
* `layer_spec(...)`: Transformer Engine spec when TE is installed and the device
  is CUDA, the local spec otherwise; in both our `TreeCoreAttention` is the
  core-attention leaf, and on the local spec our `RMSNorm` is the norm leaf
  (torch's norm refuses sequence parallelism).
* `TreeGPTModel`: a `GPTModel` whose RoPE is taken at the given `position_ids`
  (depth along each tree path) instead of 0..S-1, and which can stop before
  the LM head (`return_hidden=True`).
* `forward_packed(model, input_ids, position_ids, tree_mask, output=...)`:
  the helper the log-prob, probe and predictor code use; `output_weight(model)`
  is the (vocab-parallel) LM-head weight to pair with the hidden states.
* `model_config_from_hf(hf_config)` reads Qwen3 / Qwen3-MoE / Qwen2 / Llama configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from trace_mega.config import ModelConfig, ParallelConfig
from trace_mega.learner.routing_replay import replaying
from trace_mega.ops.attention import TreeCoreAttention

__all__ = [
    "RMSNorm",
    "TreeGPTModel",
    "transformer_config",
    "layer_spec",
    "build_model",
    "padded_vocab_size",
    "forward_packed",
    "output_weight",
    "model_config_from_hf",
    "unwrap",
    "ACTIVATIONS",
    "HF_ACTIVATIONS",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "relu": F.relu}
"""`ModelConfig.activation` -> the function megatron's gated MLP applies to the gate half."""

# HF `hidden_act` -> ModelConfig.activation: exactly the same function (transformers' ACT2FN), so
# the conversion is exact. Every other value is refused at load.
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}


class RMSNorm(torch.nn.Module):
    """RMSNorm leaf with megatron's norm constructor; weights tagged for sequence parallelism.

    Under sequence parallelism each TP rank normalises different tokens, so the
    weight gradients must be summed over TP; megatron's `finalize_model_grads`
    does that for parameters carrying `sequence_parallel=True`.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 like HF's Qwen/Llama RMSNorm, then cast back.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Vocabulary padded up to a multiple of the TP size (each rank holds an equal slice)."""
    return -(-vocab_size // tp_size) * tp_size


def _use_te(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None


def transformer_config(model: ModelConfig, parallel: ParallelConfig, device: torch.device) -> TransformerConfig:
    """megatron `TransformerConfig` for `model` under `parallel` on `device`."""
    dtype = _DTYPES[model.params_dtype]
    moe = model.num_experts is not None
    if moe and model.moe_router_topk == 1 and model.moe_norm_topk_prob:
        raise ValueError(
            "model.moe_norm_topk_prob with moe_router_topk 1 (HF norm_topk_prob at num_experts_per_tok "
            "1): megatron-core's top-1 router is pre-softmax only; set moe_norm_topk_prob false"
        )
    kwargs: dict[str, Any] = {}
    if moe:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            # Qwen3-MoE: softmax over all experts, top-k; with norm_topk_prob the
            # top-k weights are renormalised == softmax over the top-k logits,
            # which is megatron's non-pre-softmax order.
            moe_router_pre_softmax=not model.moe_norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            # Experts are sharded by EP only, never by TP (megatron's "parallel folding").
            expert_tensor_parallel_size=1,
        )
    if parallel.recompute_activations:  # every layer: routing replay queues one recompute per layer
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tp = parallel.tensor_model_parallel_size
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[model.activation],
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=0.02,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        # megatron-core requires sequence parallelism for MoE with TP > 1.
        sequence_parallel=tp > 1 and (parallel.sequence_parallel or moe),
        # Packed micro-batches differ in length: PP must exchange shapes.
        variable_seq_lengths=True,
        # Checked even for dense models: allgather refuses variable_seq_lengths.
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        use_cpu_initialization=device.type == "cpu",
        **kwargs,
    )


def layer_spec(model: ModelConfig, config: TransformerConfig, device: torch.device) -> ModuleSpec:
    """One decoder layer's spec with our core-attention leaf (and RMSNorm leaves on the local spec)."""
    attention_leaf = ModuleSpec(module=TreeCoreAttention, params={"backend": model.attention_backend})
    if _use_te(device):
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=False, qk_layernorm=model.qk_layernorm
        )
        attn = spec.submodules.self_attention
        attn.submodules = dataclasses.replace(attn.submodules, core_attention=attention_leaf)
        return spec
    spec = get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm",
    )
    attn = spec.submodules.self_attention
    attn.submodules = dataclasses.replace(
        attn.submodules,
        core_attention=attention_leaf,
        q_layernorm=RMSNorm if model.qk_layernorm else attn.submodules.q_layernorm,
        k_layernorm=RMSNorm if model.qk_layernorm else attn.submodules.k_layernorm,
    )
    spec.submodules = dataclasses.replace(spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return spec


class TreeGPTModel(GPTModel):
    """`GPTModel` for packed rollout trees: RoPE at `position_ids`, tree mask via `attention_mask`.

    `attention_mask` is `None` (causal) or the `(2, B, S)` int mask of
    `attention.tree_attention_mask`. Returns hidden states `(S, B, H)` on non-last
    pipeline stages and with `return_hidden=True` (gathered over sequence
    parallelism), else vocab-parallel logits `(B, S, V/tp)`, or per-token
    losses `(B, S)` when `labels` are given. `routing` `(B, S, L, k)`: the rollout engine's experts,
    replayed by a model with `routing_replay.install`ed replays (ignored by one without).

    Under sequence parallelism the gradient of the returned hidden states is
    reduce-scattered (summed) over TP: right for a vocab-parallel consumer like
    the LM head, where each rank contributes a partial gradient.
    """

    def __init__(self, *args: Any, true_vocab_size: Optional[int] = None, **kwargs: Any) -> None:
        """GPTModel's arguments, plus the unpadded vocabulary size (default: `vocab_size`)."""
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size or self.vocab_size

    def _rotary_at(self, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        if self.position_embedding_type != "rope":
            return None
        rope = self.rotary_pos_emb
        inv_freq = rope.inv_freq.to(position_ids.device)  # (D/2,)
        pos = position_ids.t().to(inv_freq.dtype)  # (S, B)
        if rope.seq_len_interpolation_factor is not None:
            pos = pos / rope.seq_len_interpolation_factor
        freqs = pos[..., None] * inv_freq  # (S, B, D/2)
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # (S, B, 1, D), non-interleaved halves

    def _pad_for_sequence_parallel(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Pad the sequence to a multiple of TP (sequence parallelism splits it evenly).

        Pads go at the end, so causality hides them from every real token; in a
        tree mask they form their own node (id above every real one).
        """
        tp = self.config.tensor_model_parallel_size
        pad = (-input_ids.shape[1]) % tp if self.config.sequence_parallel else 0
        if pad == 0:
            return input_ids, position_ids, attention_mask
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = F.pad(position_ids, (0, pad))
        if attention_mask is not None:
            pad_node = attention_mask[1].max() + 1  # (); a device scalar, no host sync
            tail = pad_node.expand(2, attention_mask.shape[1], pad)
            attention_mask = torch.cat((attention_mask, tail), dim=2)
        return input_ids, position_ids, attention_mask

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        return_hidden: bool = False,
        routing: Optional[torch.Tensor] = None,
        **unsupported: Any,
    ) -> torch.Tensor:
        if any(v is not None for v in unsupported.values()):
            raise ValueError(f"TreeGPTModel.forward does not support {sorted(unsupported)}")
        seq_len = input_ids.shape[1]
        input_ids, position_ids, attention_mask = self._pad_for_sequence_parallel(
            input_ids, position_ids, attention_mask
        )
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)  # (S[/tp], B, H)
        with replaying(self, routing, input_ids.shape[1]):
            hidden = self.decoder(
                hidden_states=decoder_input,
                attention_mask=attention_mask,
                rotary_pos_emb=self._rotary_at(position_ids),
            )  # (S[/tp], B, H)
        if not self.post_process:
            return hidden
        if return_hidden:
            if self.config.sequence_parallel:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    hidden, tensor_parallel_output_grad=True, group=self.pg_collection.tp
                )
            return hidden[:seq_len]  # (S, B, H)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)  # (S_pad, B, V/tp)
        logits = logits[:seq_len]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # (B, S, V/tp)
        return self.compute_language_model_loss(labels, logits)  # (B, S)


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    pgs: ProcessGroupCollection,
    device: torch.device,
    pp_rank: int,
    pp_size: int,
    vocab_multiple: Optional[int] = None,
) -> TreeGPTModel:
    """This pipeline stage's `TreeGPTModel` on `device` (unwrapped; see optim.wrap_ddp).

    The vocabulary is padded to a multiple of `vocab_multiple` (default: the TP size); a
    model that loads a checkpoint saved at another TP size pads as that run did.
    """
    config = transformer_config(model, parallel, device)
    spec = layer_spec(model, config, device)
    n_layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    block = TransformerBlockSubmodules(layer_specs=[spec] * n_layers, layer_norm=RMSNorm)
    net = TreeGPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=padded_vocab_size(model.vocab_size, vocab_multiple or parallel.tensor_model_parallel_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        pg_collection=pgs,
        true_vocab_size=model.vocab_size,
    )
    return net.to(device)


def unwrap(model: torch.nn.Module) -> TreeGPTModel:
    """The `TreeGPTModel` inside DDP / Float16Module wrappers."""
    while not isinstance(model, TreeGPTModel):
        model = model.module
    return model


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """LM-head weight `(V_padded/tp, H)` of this TP rank (rows tp_rank*V/tp ...); last PP stage only."""
    net = unwrap(model)
    if net.share_embeddings_and_output_weights:
        return net.shared_embedding_or_output_weight()
    return net.output_layer.weight


def forward_packed(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    output: Literal["hidden", "logits", "full_logits"] = "hidden",
) -> torch.Tensor:
    """One packed forward: ids/positions `(B, T)`, tree mask `(2, B, T)` or None.

    output="hidden": final-norm hidden states `(B, T, H)` (pair with
    `output_weight(model)`); "logits": vocab-parallel logits `(B, T, V_padded/tp)`;
    "full_logits": logits gathered over TP and cut to the true vocabulary `(B, T, V)`.
    Call on the last pipeline stage's view (PP=1) or inside a schedule.
    """
    if output == "hidden":
        return model(input_ids, position_ids, tree_mask, return_hidden=True).transpose(0, 1)
    logits = model(input_ids, position_ids, tree_mask)  # (B, T, V/tp)
    if output == "logits":
        return logits
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=unwrap(model).pg_collection.tp)
    return full[..., : unwrap(model).true_vocab_size]


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope type {rope_type!r} is not supported (default RoPE only)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _refuse_sliding_window(hf_config: Any) -> None:
    """Raise naming the HF field when some layer attends through a sliding window that can bind.

    Qwen2 / Qwen3 mark sliding layers in `layer_types` (derived from `use_sliding_window` and
    `max_window_layers`); Qwen3-MoE slides on every layer when `use_sliding_window`. The tree
    attention here is full causal, which equals a window only when the window is at least
    max_position_embeddings (no sequence the model is built for is longer).
    """
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        field = "layer_types (from use_sliding_window / max_window_layers)"
    else:
        sliding = list(range(hf_config.num_hidden_layers)) if getattr(hf_config, "use_sliding_window", False) else []
        field = "use_sliding_window"
    if sliding and window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(
            f"HF config {field} puts layers {sliding} on sliding-window attention "
            f"(sliding_window={window} < max_position_embeddings={hf_config.max_position_embeddings}); "
            "the learner's tree attention is full causal and cannot represent it exactly"
        )


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """`ModelConfig` from a transformers Qwen3 / Qwen3-MoE / Qwen2 / Llama config (raises on others)."""
    model_type = hf_config.model_type
    if model_type not in ("qwen3", "qwen3_moe", "qwen2", "llama"):
        raise ValueError(f"unsupported HF model_type {model_type!r}: qwen3, qwen3_moe, qwen2, llama")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if model_type == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias / mlp_bias is not supported")
    if model_type == "qwen3" and getattr(hf_config, "attention_bias", False):
        raise ValueError("Qwen3 with attention_bias is not supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise ValueError(
            f"HF config hidden_act={act!r} is not supported: megatron's gated MLP is built here with "
            f"one of {sorted(HF_ACTIVATIONS)}"
        )
    _refuse_sliding_window(hf_config)
    fields: dict[str, Any] = dict(
        activation=HF_ACTIVATIONS[act],
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads or heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rotary_base=_rope_theta(hf_config),
        norm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
    )
    if model_type == "qwen3_moe":
        if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
        if hf_config.num_experts_per_tok == 1 and hf_config.norm_topk_prob:
            # Top-1 renormalised: every routed weight is exactly 1. megatron-core's router only has
            # top-1 as pre-softmax (weight = the softmax probability), which is a different model.
            raise ValueError(
                "HF config num_experts_per_tok=1 with norm_topk_prob=true (every routed weight is 1) "
                "cannot be represented by megatron-core's router (top-1 needs pre-softmax "
                "routing, weight = softmax probability); only norm_topk_prob=false converts at top-1"
            )
        fields.update(
            num_experts=getattr(hf_config, "num_experts", None) or hf_config.num_local_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_norm_topk_prob=bool(hf_config.norm_topk_prob),
        )
    fields.update(overrides)
    return ModelConfig(**fields)
