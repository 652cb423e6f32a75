"""HF (safetensors) <-> Megatron-Core weight conversion, sharded by TP / EP / PP rank.

* `load_hf_into(model, hf_dir, groups)`: copy this rank's shard of every
  parameter of `model` (one pipeline stage) from an HF checkpoint directory
  (`model.safetensors` or a sharded `model.safetensors.index.json`).
* `export_hf(model, groups)`: `Iterator[(hf_name, tensor)]` of full HF
  tensors for this stage's layers, gathered over TP and EP. This is also the
  in-memory weight-sync path to rollout engines (vLLM's `load_weights` takes
  HF names). `save_hf(model, groups, out_dir, hf_config)` writes one
  safetensors shard per pipeline stage plus the index.

Layouts (megatron-core 0.16.1):
* `linear_qkv` rows are grouped per query group: `[q_g0 (heads/group*D), k_g0 (D), v_g0 (D), q_g1, ...]`,
  split contiguously over TP (same for the Qwen2 QKV bias).
* `linear_fc1` (SwiGLU) on TP rank r holds `[gate_r; up_r]` (each the r-th TP chunk).
* `linear_proj`, `linear_fc2` are row-parallel: input columns split over TP.
* `word_embeddings` / `output_layer`: vocab rows padded to a multiple of TP, split over TP.
* MoE: `router.weight` replicated; experts only EP-sharded (expert TP = 1):
  rank e holds global experts `e*E/ep .. (e+1)*E/ep - 1` as `local_experts.{j}`.
* Tied embeddings: the last stage's `output_layer.weight` (PP > 1) is a copy
  of `embed_tokens`; it is loaded from it and not exported.
Names of the Transformer Engine spec's fused norms (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`) map to the same HF norms.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from trace_mega.learner.models import TreeGPTModel, unwrap
from trace_mega.learner.parallel import ParallelGroups

__all__ = ["HFCheckpoint", "load_hf_into", "export_hf", "save_hf"]


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded index)."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: path / fname for name, fname in weight_map.items()}
        elif (path / "model.safetensors").exists():
            with safe_open(path / "model.safetensors", "pt") as f:
                self._files = {name: path / "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return sorted(self._files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        with safe_open(self._files[name], "pt") as f:
            return f.get_tensor(name)


# ------------------------------------------------------------------ name map
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_LAYER_SIMPLE = {
    "input_layernorm.weight": ("input_layernorm.weight", "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", "replicated"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", "replicated"),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", "replicated"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", "cols"),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", "replicated"),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight", "replicated"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", "cols"),
    "mlp.router.weight": ("mlp.gate.weight", "replicated"),
}


def _mapping(net: TreeGPTModel, name: str, ep_rank: int) -> tuple[list[str], str]:
    """(HF names, layout kind) of the megatron parameter `name` of this stage."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"], "vocab"
    if name == "output_layer.weight":
        tied = net.share_embeddings_and_output_weights
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"], "vocab"
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"], "replicated"
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF mapping for megatron parameter {name!r}")
    local, rest = int(m.group(1)), m.group(2)
    pre = f"model.layers.{net.decoder.layers[local].layer_number - 1}."
    if rest in _LAYER_SIMPLE:
        hf, kind = _LAYER_SIMPLE[rest]
        return [pre + hf], kind
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = rest.rsplit(".", 1)[1]
        return [pre + f"self_attn.{p}_proj.{suffix}" for p in "qkv"], "qkv"
    if rest == "mlp.linear_fc1.weight":
        return [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"], "gate_up"
    m = _EXPERT.match(rest)
    if m is not None:
        expert = ep_rank * net.config.num_moe_experts // _ep_size(net) + int(m.group(1))
        e = pre + f"mlp.experts.{expert}."
        if m.group(2) == "linear_fc1":
            return [e + "gate_proj.weight", e + "up_proj.weight"], "expert_gate_up"
        return [e + "down_proj.weight"], "expert"
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


def _ep_size(net: TreeGPTModel) -> int:
    return net.config.expert_model_parallel_size


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF q (Hq*D, ...), k/v (G*D, ...) -> megatron per-group interleaved (G*(Hq/G+2)*D, ...)."""
    rest = q.shape[1:]
    qg = q.reshape(groups, -1, *rest)  # (G, Hq/G*D, ...)
    kg = k.reshape(groups, -1, *rest)  # (G, D, ...)
    vg = v.reshape(groups, -1, *rest)
    return torch.cat((qg, kg, vg), dim=1).reshape(-1, *rest)


def _qkv_split(fused: torch.Tensor, groups: int, q_rows: int) -> tuple[torch.Tensor, ...]:
    """Inverse of `_qkv_fuse`: returns q (q_rows, ...), k, v."""
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, -1, *rest)  # (G, (Hq/G+2)*D, ...)
    qd = q_rows // groups
    kd = (per_group.shape[1] - qd) // 2
    q, k, v = torch.split(per_group, [qd, kd, kd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))


def _shard(net: TreeGPTModel, kind: str, hf: list[torch.Tensor], g: ParallelGroups, shape: torch.Size) -> torch.Tensor:
    tp, r = g.tp_size, g.tp_rank
    if kind in ("replicated", "expert"):
        return hf[0]
    if kind == "expert_gate_up":
        return torch.cat(hf)
    if kind == "vocab":
        return _pad_rows(hf[0], shape[0] * tp).chunk(tp)[r]
    if kind == "cols":
        return hf[0].chunk(tp, dim=1)[r]
    if kind == "gate_up":
        return torch.cat((hf[0].chunk(tp)[r], hf[1].chunk(tp)[r]))
    if kind == "qkv":
        return _qkv_fuse(*hf, net.config.num_query_groups).chunk(tp)[r]
    raise ValueError(kind)


def _params(net: TreeGPTModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters by name; the tied output weight (on the first stage it is the embedding) once."""
    seen: set[int] = set()
    for name, p in net.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, hf_dir: str | os.PathLike | HFCheckpoint, g: ParallelGroups) -> None:
    """Copy this rank's shard of every parameter of `model` (this PP stage) from an HF checkpoint."""
    net = unwrap(model)
    ckpt = hf_dir if isinstance(hf_dir, HFCheckpoint) else HFCheckpoint(hf_dir)
    for name, param in _params(net):
        hf_names, kind = _mapping(net, name, g.ep_rank)
        shard = _shard(net, kind, [ckpt.get(n) for n in hf_names], g, param.shape)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: HF {hf_names} give shard {tuple(shard.shape)}, parameter is {tuple(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    if group.size() == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _unshard(
    net: TreeGPTModel, kind: str, local: torch.Tensor, hf_names: list[str], g: ParallelGroups
) -> list[torch.Tensor]:
    if kind in ("replicated", "expert"):
        return [local]
    if kind == "expert_gate_up":
        return list(local.chunk(2))
    parts = _gather(local, g.pgs.tp)
    if kind == "vocab":
        return [torch.cat(parts)[: net.true_vocab_size]]
    if kind == "cols":
        return [torch.cat(parts, dim=1)]
    if kind == "gate_up":
        halves = [p.chunk(2) for p in parts]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == "qkv":
        cfg = net.config
        return list(_qkv_split(torch.cat(parts), cfg.num_query_groups, cfg.num_attention_heads * cfg.kv_channels))
    raise ValueError(kind)


@torch.no_grad()
def export_hf(
    model: torch.nn.Module, g: ParallelGroups, dtype: Optional[torch.dtype] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of this PP stage, gathered over TP and EP (collective: call on all ranks).

    Every rank of a (TP, EP) group receives the same tensors. Experts are
    yielded in global order once all EP ranks' local experts are gathered.
    """
    net = unwrap(model)
    ep = g.pgs.ep
    for name, param in _params(net):
        if name == "output_layer.weight" and net.share_embeddings_and_output_weights:
            continue  # a copy of embed_tokens on the last stage
        hf_names, kind = _mapping(net, name, g.ep_rank)
        tensors = _unshard(net, kind, param.detach(), hf_names, g)
        if kind.startswith("expert"):
            # EP rank r holds the same local slot for its own global expert.
            per_rank = [_gather(t, ep) for t in tensors]  # [tensor][ep_rank]
            for r in range(ep.size()):
                for n, t in zip(_mapping(net, name, r)[0], (pt[r] for pt in per_rank)):
                    yield n, t if dtype is None else t.to(dtype)
            continue
        for n, t in zip(hf_names, tensors):
            yield n, t if dtype is None else t.to(dtype)


def save_hf(
    model: torch.nn.Module,
    g: ParallelGroups,
    out_dir: str | os.PathLike,
    hf_config=None,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write an HF checkpoint: one safetensors shard per PP stage + index (+ config.json). Collective."""
    out = Path(out_dir)
    tensors = {n: t.contiguous().cpu() for n, t in export_hf(model, g, dtype)}
    writer = g.tp_rank == 0 and g.dp_rank == 0 and g.ep_rank == 0
    fname = f"model-{g.pp_rank + 1:05d}-of-{g.pp_size:05d}.safetensors"
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    names: list[Optional[list[str]]] = [None] * g.world_size
    dist.all_gather_object(names, sorted(tensors) if writer else [])
    stages: list[Optional[int]] = [None] * g.world_size
    dist.all_gather_object(stages, g.pp_rank if writer else -1)
    if g.rank == 0:
        weight_map = {
            n: f"model-{pp + 1:05d}-of-{g.pp_size:05d}.safetensors"
            for ns, pp in zip(names, stages)
            if pp is not None and pp >= 0
            for n in ns
        }
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
        if hf_config is not None:
            hf_config.save_pretrained(out)
    dist.barrier()
