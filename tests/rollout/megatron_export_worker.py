"""Subprocess worker for the vLLM tests: tiny Megatron-Core policies exported to HF names.

Run as a script (its own process: it starts torch.distributed, which must not
share a process with the in-process vLLM engine core).

Usage: megatron_export_worker.py --out DIR
Writes
* DIR/policy_a/ — policy A (seed 0) as an HF checkpoint via `convert.save_hf`
  (safetensors + index + config.json): what the engines start from;
* DIR/policy_b.safetensors — policy B (seed 1) as the `convert.export_hf`
  stream (name -> full tensor): the weight update the engines receive.
Both are random Megatron-initialised TreeGPTModels of the same Qwen3 shape.
The config carries no `architectures` (like the trainer's `hf_config`), so
the engines must cope with what the converter writes.
"""

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from trace_mega.config import ParallelConfig
from trace_mega.learner.convert import export_hf, save_hf
from trace_mega.learner.models import build_model, model_config_from_hf
from trace_mega.learner.parallel import destroy_parallel, init_parallel


def hf_config() -> Qwen3Config:
    """2 layers, 4 query / 2 KV heads of head_dim 64 (vLLM's CPU attention rejects head_dim 16)."""
    return Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def policy(seed: int, par: ParallelConfig, g):
    torch.manual_seed(seed)
    net = build_model(
        model_config_from_hf(hf_config(), attention_backend="sdpa"), par, g.pgs, g.device, g.pp_rank, g.pp_size
    )
    with torch.no_grad():
        # Megatron's init (std 0.02, unit norms) gives near-uniform logits; widen it so greedy
        # argmaxes are far from ties and a wrong norm mapping would show.
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(10.0)
    return net.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    par = ParallelConfig(device="cpu")
    g = init_parallel(par, seed=0)
    save_hf(policy(0, par, g), g, out / "policy_a", hf_config())
    stream = {name: t.contiguous().clone() for name, t in export_hf(policy(1, par, g), g)}
    save_file(stream, str(out / "policy_b.safetensors"))
    destroy_parallel()


if __name__ == "__main__":
    main()
