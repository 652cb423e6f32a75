"""Shared by the learner tests and their torchrun workers: tiny HF models, a packed tree, a launcher.

Imported by the workers (run as scripts, this directory on sys.path) and by the
tests (tests/learner on sys.path, as `workers.common`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
WORKERS = Path(__file__).resolve().parent

# Pre-order tree: node -> (parent, n_tokens). Three paths: 0-1, 0-2-3, 0-4.
TREE = {0: (-1, 6), 1: (0, 5), 2: (0, 4), 3: (2, 3), 4: (0, 3)}


def tiny_hf_config(kind: str, tie: bool = False):
    """A tiny transformers config: Qwen3 (`dense`), Qwen3-MoE (`moe`), `qwen2` (QKV bias), `llama`, `llama_gelu`."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        attention_dropout=0.0,
    )
    if kind == "dense":
        return Qwen3Config(**common)
    if kind == "qwen2":
        return Qwen2Config(**{k: v for k, v in common.items() if k != "head_dim"})
    if kind in ("llama", "llama_gelu"):  # llama_gelu: a GeGLU Llama (hidden_act gelu), mapped exactly
        return LlamaConfig(
            **{k: v for k, v in common.items() if k != "head_dim"},
            rope_theta=500000.0,
            hidden_act="gelu" if kind == "llama_gelu" else "silu",
        )
    return Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def save_tiny_hf(kind: str, out: Path, seed: int = 0, tie: bool = False) -> Path:
    """Create and save a random tiny HF model (fp32 safetensors); returns its directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, tie)).eval()
    with torch.no_grad():  # non-trivial norms and biases so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def packed_tree(seed: int, vocab: int = 128) -> dict[str, torch.Tensor]:
    """The packed layout of docs/PACKING.md for `TREE` (batch 1), plus each path's stream indices."""
    g = torch.Generator().manual_seed(seed)
    exit_ = {n: n for n in TREE}
    for n in sorted(TREE, reverse=True):
        p = TREE[n][0]
        if p >= 0:
            exit_[p] = max(exit_[p], exit_[n])
    node, node_exit, pos, prev = [], [], [], []
    last_index: dict[int, int] = {}
    depth_end: dict[int, int] = {}
    for n in sorted(TREE):
        parent, length = TREE[n]
        start_depth = 0 if parent < 0 else depth_end[parent]
        for t in range(length):
            node.append(n)
            node_exit.append(exit_[n])
            pos.append(start_depth + t)
            if t == 0:
                prev.append(-1 if parent < 0 else last_index[parent])
            else:
                prev.append(len(prev) - 1)
        last_index[n] = len(node) - 1
        depth_end[n] = start_depth + length
    T = len(node)
    return {
        "input_ids": torch.randint(0, vocab, (1, T), generator=g),
        "position_ids": torch.tensor([pos]),
        "token_node": torch.tensor([node]),
        "token_node_exit": torch.tensor([node_exit]),
        "prev_index": torch.tensor([prev]),
    }


def tree_paths() -> list[list[int]]:
    """Root-to-leaf node lists of `TREE`."""
    children = {n: [c for c, (p, _) in TREE.items() if p == n] for n in TREE}
    paths, stack = [], [[0]]
    while stack:
        path = stack.pop()
        kids = children[path[-1]]
        if not kids:
            paths.append(path)
        stack.extend(path + [k] for k in kids)
    return sorted(paths)


def path_indices(batch: dict[str, torch.Tensor], path: list[int]) -> torch.Tensor:
    """Stream indices of the tokens of a root-to-leaf path, in path order."""
    node = batch["token_node"][0]
    return torch.cat([torch.nonzero(node == n).flatten() for n in path])


def next_token_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tree next-token cross-entropy on vocab-parallel logits `(1, T, V/tp)`: token i from logits at prev_index[i]."""
    from megatron.core import tensor_parallel

    prev = batch["prev_index"][0]
    valid = prev >= 0
    rows = logits[0, prev[valid]]  # (N, V/tp)
    targets = batch["input_ids"][0, valid]  # (N,)
    ce = tensor_parallel.vocab_parallel_cross_entropy(rows[:, None].float(), targets[:, None])  # (N, 1)
    return ce.sum(), valid.sum(), {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, args: list[str], timeout: int = 240) -> str:
    """Run `workers/<script>` under torchrun (gloo, 1 thread per process); return stdout, raise on failure."""
    # TRITON_INTERPRET passes through as tests/conftest.py set it (the interpreter without CUDA)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKERS), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(WORKERS / script),
        *args,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}")
    return res.stdout


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
