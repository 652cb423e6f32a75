"""The policy's HF views: its transformers config (what the rollout engines build and an export
carries), and the files of an HF export beside its weights (the tokenizer with its chat template,
`generation_config.json`), written by `Trainer.export_hf` and `trace-mega export`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_mega.config import TrainConfig


def policy_tokenizer(cfg: TrainConfig, env: Any = None) -> Any:
    """The policy's tokenizer: the HF checkpoint's, else the one the environment ships (synthetic envs)."""
    if cfg.model.hf_checkpoint:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
    if env is None:
        from trace_mega.envs import build_env

        env = build_env(cfg.env.name, **cfg.env.options)
    tok = getattr(env, "tokenizer", None)
    if tok is None:
        raise ValueError(f"environment {cfg.env.name!r} ships no tokenizer: set model.hf_checkpoint")
    return tok


def write_hf_extras(out_dir: str | Path, cfg: TrainConfig, tokenizer: Any) -> None:
    """Tokenizer files, `generation_config.json`, and the tokenizer's special ids in `config.json`."""
    from transformers import AutoConfig, GenerationConfig

    out = Path(out_dir)
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(out)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            setattr(config, name, value)
    config.save_pretrained(out)
    if cfg.model.hf_checkpoint and (Path(cfg.model.hf_checkpoint) / "generation_config.json").exists():
        gen = GenerationConfig.from_pretrained(cfg.model.hf_checkpoint)
    else:
        gen = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
    rc = cfg.rollout
    if rc.temperature > 0:
        gen.update(do_sample=True, temperature=rc.temperature, top_p=rc.top_p)
    else:
        gen.update(do_sample=False, temperature=None, top_p=None)
    gen.save_pretrained(out)


def hf_config(model_cfg) -> Any:
    """A transformers config describing the same network (the rollout engines' view of the policy)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.norm_epsilon,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(model_cfg.rotary_base)},
        hidden_act={"gelu_tanh": "gelu_pytorch_tanh"}.get(model_cfg.activation, model_cfg.activation),
        attention_bias=False,
        torch_dtype="float32",
    )
    if not model_cfg.qk_layernorm:
        raise ValueError("the rollout engines' HF view is Qwen3 (q/k-norm); set model.qk_layernorm: true")
    if model_cfg.num_experts:
        return Qwen3MoeConfig(
            num_experts=model_cfg.num_experts,
            num_experts_per_tok=model_cfg.moe_router_topk,
            moe_intermediate_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
            norm_topk_prob=model_cfg.moe_norm_topk_prob,
            **common,
        )
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
