"""The files of an HF export beside its weights: the policy's tokenizer (with its chat template) and
`generation_config.json`, written by `Trainer.export_hf` and `trace-mega export`."""

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
