"""`TreeCoreAttention`: the core-attention `ModuleSpec` leaf for packed rollout trees.

It has megatron-core's core-attention contract (`DotProductAttention` in
0.16.1): built with `(config, layer_number, attn_mask_type, attention_type,
attention_dropout, softmax_scale, cp_comm_type, pg_collection)`, called as
`forward(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
packed_seq_params=)` with query `(S, B, Hq/tp, D)`, key/value `(S, B, Hkv/tp, D)`,
returning `(S, B, Hq/tp * D)`. `SelfAttention` hands it this rank's heads, so it
works under tensor parallelism unchanged.

`attention_mask` carries the tree (docs/PACKING.md) as per-token int arrays,
never an (S, S) tensor: `tree_attention_mask(token_node, token_node_exit)`
stacks them into `(2, B, S)`. Query i attends key j iff
`token_node[j] <= token_node[i] <= token_node_exit[j] and j <= i`.
`attention_mask=None` is plain causal attention.

Backends: `sdpa` (PyTorch scaled_dot_product_attention with the mask
materialised per call; differentiable on CPU; GQA), `tree_triton`
(`trace_mega.kernels.tree_attention.tree_attention`, imported lazily) and
`auto` (tree_triton on CUDA, sdpa otherwise).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

__all__ = ["TreeCoreAttention", "tree_attention_mask", "tree_mask_dense", "BACKENDS"]

BACKENDS = ("auto", "sdpa", "tree_triton")


def tree_attention_mask(token_node: torch.Tensor, token_node_exit: torch.Tensor) -> torch.Tensor:
    """Pack the two per-token arrays `(B, S)` (or `(S,)`) into the `(2, B, S)` int64 mask."""
    if token_node.shape != token_node_exit.shape:
        raise ValueError(f"token_node {tuple(token_node.shape)} != token_node_exit {tuple(token_node_exit.shape)}")
    if token_node.dim() == 1:
        token_node, token_node_exit = token_node[None], token_node_exit[None]
    return torch.stack((token_node, token_node_exit)).long()


def tree_mask_dense(tree_mask: torch.Tensor) -> torch.Tensor:
    """Boolean `(B, 1, S, S)` "may attend" matrix of a `(2, B, S)` tree mask (True = attend)."""
    node, node_exit = tree_mask[0], tree_mask[1]  # (B, S) each
    q_node = node[:, :, None]  # (B, S, 1): query i
    allowed = (node[:, None, :] <= q_node) & (q_node <= node_exit[:, None, :])  # (B, S, S)
    s = node.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=node.device).tril()
    return (allowed & causal)[:, None]


class TreeCoreAttention(MegatronModule):
    """Core attention over this TP rank's heads with the packed-tree rule (see module doc)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if config.context_parallel_size != 1:
            raise ValueError("TreeCoreAttention does not support context parallelism")
        if config.apply_query_key_layer_scaling:
            raise ValueError("TreeCoreAttention does not support apply_query_key_layer_scaling")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = layer_number
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backend = backend

    def _resolve_backend(self, device: torch.device) -> str:
        if self.backend == "auto":
            return "tree_triton" if device.type == "cuda" else "sdpa"
        return self.backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query `(S, B, Hq, D)`, key/value `(S, B, Hkv, D)`, mask `(2, B, S)` int or None -> `(S, B, Hq*D)`."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("TreeCoreAttention takes the tree through attention_mask, not bias/packed_seq_params")
        if attention_mask is not None and (
            attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool
        ):
            raise TypeError("attention_mask must be the (2, B, S) int tree mask of tree_attention_mask() or None")
        s, b = query.shape[0], query.shape[1]
        if self._resolve_backend(query.device) == "tree_triton":
            out = self._tree_triton(query, key, value, attention_mask)  # (B, S, Hq, D)
        else:
            out = self._sdpa(query, key, value, attention_mask)  # (B, S, Hq, D)
        return out.transpose(0, 1).reshape(s, b, self.num_heads * self.head_dim)

    def _sdpa(self, query, key, value, attention_mask) -> torch.Tensor:
        q = query.permute(1, 2, 0, 3)  # (B, Hq, S, D)
        k = key.permute(1, 2, 0, 3)  # (B, Hkv, S, D)
        v = value.permute(1, 2, 0, 3)
        dropout_p = self.dropout_p if self.training else 0.0
        mask = None if attention_mask is None else tree_mask_dense(attention_mask)  # (B, 1, S, S)
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=mask is None,
                scale=self.softmax_scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # (B, Hq, S, D)
        return out.transpose(1, 2)

    def _tree_triton(self, query, key, value, attention_mask) -> torch.Tensor:
        from trace_mega.kernels.tree_attention import tree_attention

        if self.dropout_p > 0 and self.training:
            raise ValueError("tree_triton attention has no dropout; set attention_dropout=0")
        q = query.transpose(0, 1)  # (B, S, Hq, D)
        k = key.transpose(0, 1)  # (B, S, Hkv, D)
        v = value.transpose(0, 1)
        if attention_mask is None:
            # Plain causal: every token in one node (token_node = token_node_exit = 0).
            node = torch.zeros(q.shape[0], q.shape[1], dtype=torch.long, device=q.device)
            node_exit = node
        else:
            node, node_exit = attention_mask[0], attention_mask[1]
        return tree_attention(q, k, v, node, node_exit, scale=self.softmax_scale)
