"""Pure-PyTorch references for tree attention over a packed rollout tree.

The packed layout and the attention rule are defined in docs/PACKING.md:
query token i may attend key token j iff

    token_node[j] <= token_node[i] <= token_node_exit[j]   and   j <= i

Padding convention (shared with the Triton kernel in ``tree_attention.py``):
a token with ``token_node < 0`` is padding.  It attends nothing and is
attended by nothing, its output row is 0 and it receives / passes no
gradient.  Its ``token_node_exit`` value is ignored.

Everything here materialises the O(T^2) mask; these functions exist for
tests and benchmarks only, never for training.

Also here: :func:`tree_layout`, a tiny builder of ``token_node`` /
``token_node_exit`` arrays from a parent list, used by the tests and the
benchmark to describe trees without depending on the rollout package.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "tree_mask",
    "tree_attention_reference",
    "tree_attention_flex",
    "tree_flex_block_mask",
    "tree_layout",
]


def _check_tokens(token_node: torch.Tensor, token_node_exit: torch.Tensor) -> None:
    if token_node.dim() != 2 or token_node.shape != token_node_exit.shape:
        raise ValueError(
            "token_node and token_node_exit must both be (B, T), got "
            f"{tuple(token_node.shape)} and {tuple(token_node_exit.shape)}"
        )
    if token_node.dtype.is_floating_point or token_node_exit.dtype.is_floating_point:
        raise ValueError("token_node / token_node_exit must be integer tensors")


def tree_mask(token_node: torch.Tensor, token_node_exit: torch.Tensor) -> torch.Tensor:
    """Materialised attention mask (B, T, T), True where query i may attend key j.

    ``mask[b, i, j]`` follows the rule in the module docstring; padding tokens
    (``token_node < 0``) have all-False rows and columns.
    """
    _check_tokens(token_node, token_node_exit)
    T = token_node.shape[1]
    n_q = token_node[:, :, None]  # (B, T, 1): node of query i
    n_k = token_node[:, None, :]  # (B, 1, T): node of key j
    e_k = token_node_exit[:, None, :]  # (B, 1, T): exit of key j's node
    idx = torch.arange(T, device=token_node.device)
    causal = idx[None, :] <= idx[:, None]  # (T, T): j <= i
    valid = (n_q >= 0) & (n_k >= 0)
    return (n_k <= n_q) & (n_q <= e_k) & causal[None] & valid


def _to_bhtd(x: torch.Tensor) -> torch.Tensor:
    # (B, T, H, D) -> (B, H, T, D), the layout SDPA / flex_attention expect
    return x.transpose(1, 2)


def _check_qkv(q, k, v, token_node) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, T, H, D)")
    B, T, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(
            f"k, v must be (B, T, Hkv, D) matching q {tuple(q.shape)}, got {tuple(k.shape)} / {tuple(v.shape)}"
        )
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv} (GQA)")
    if tuple(token_node.shape) != (B, T):
        raise ValueError(f"token_node must be (B, T)=({B}, {T}), got {tuple(token_node.shape)}")
    return Hq, Hkv


def tree_attention_reference(q, k, v, token_node, token_node_exit, *, scale=None):
    """SDPA with the materialised tree mask: the reference the kernel is tested against.

    Shapes as :func:`trace_mega.kernels.tree_attention.tree_attention`:
    q (B, T, Hq, D), k/v (B, T, Hkv, D) -> (B, T, Hq, D).  Differentiable.
    Computes in q's dtype (upcast the inputs for an fp32 reference).
    """
    Hq, Hkv = _check_qkv(q, k, v, token_node)
    mask = tree_mask(token_node, token_node_exit)  # (B, T, T)
    group = Hq // Hkv
    # GQA: query head h reads kv head h // group, i.e. repeat_interleave.
    kk = _to_bhtd(k).repeat_interleave(group, dim=1)  # (B, Hq, T, D)
    vv = _to_bhtd(v).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(_to_bhtd(q), kk, vv, attn_mask=mask[:, None], scale=scale)  # (B, Hq, T, D)
    # Rows with no allowed key (padding) are defined as 0; SDPA on CPU already
    # gives 0 there but some CUDA backends give NaN, so force it.
    has_key = mask.any(dim=-1)[:, None, :, None]  # (B, 1, T, 1)
    out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.transpose(1, 2)  # (B, T, Hq, D)


def _tree_mask_mod(token_node: torch.Tensor, token_node_exit: torch.Tensor):
    """flex_attention ``mask_mod`` implementing the same rule (no O(T^2) tensor)."""
    tn = token_node
    te = token_node_exit

    def mask_mod(b, h, q_idx, kv_idx):
        nq = tn[b, q_idx]
        nk = tn[b, kv_idx]
        return (nk <= nq) & (nq <= te[b, kv_idx]) & (kv_idx <= q_idx) & (nq >= 0) & (nk >= 0)

    return mask_mod


def tree_flex_block_mask(token_node: torch.Tensor, token_node_exit: torch.Tensor, *, block_size: int = 128):
    """The flex_attention ``BlockMask`` for the tree rule (for benchmarks that compile flex)."""
    from torch.nn.attention.flex_attention import create_block_mask

    _check_tokens(token_node, token_node_exit)
    B, T = token_node.shape
    return create_block_mask(
        _tree_mask_mod(token_node, token_node_exit),
        B,
        None,
        T,
        T,
        device=token_node.device,
        BLOCK_SIZE=block_size,
    )


def tree_attention_flex(q, k, v, token_node, token_node_exit, *, scale=None):
    """``torch.nn.attention.flex_attention`` peer with the same rule (eager).

    Forward only on CPU (PyTorch has no flex backward on CPU); differentiable
    on CUDA.  Padding rows are forced to 0 as in the reference.
    """
    from torch.nn.attention.flex_attention import flex_attention

    Hq, Hkv = _check_qkv(q, k, v, token_node)
    block_mask = tree_flex_block_mask(token_node, token_node_exit)
    with warnings.catch_warnings():
        # eager flex warns that it materialises the scores: that is the point of a reference
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        out = flex_attention(
            _to_bhtd(q),
            _to_bhtd(k),
            _to_bhtd(v),
            block_mask=block_mask,
            scale=scale,
            enable_gqa=Hq != Hkv,
        )  # (B, Hq, T, D)
    pad = (token_node < 0)[:, None, :, None]  # (B, 1, T, 1)
    out = torch.where(pad, torch.zeros((), dtype=out.dtype, device=out.device), out)
    return out.transpose(1, 2)


def tree_layout(parents: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Packed ``(token_node, token_node_exit)`` lists for a forest given by a parent list.

    ``parents[n]`` is node n's parent (-1 for a root), ``lengths[n]`` its token
    count (0 is allowed: an empty branch node keeps its pre-order id, it just
    owns no tokens).  Children are visited in the order they appear; roots in
    order too, so several roots give several trees in one stream.  Nodes are
    renumbered in depth-first pre-order as in docs/PACKING.md.
    """
    if len(parents) != len(lengths):
        raise ValueError("parents and lengths must have the same length")
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for n, p in enumerate(parents):
        if p < 0:
            roots.append(n)
        else:
            if not 0 <= p < len(parents) or p == n:
                raise ValueError(f"bad parent {p} for node {n}")
            children[p].append(n)
    order: list[int] = []  # pre-order of original node indices
    exit_of: dict[int, int] = {}
    # iterative DFS so deep chains do not hit the recursion limit
    for r in roots:
        stack = [(r, False)]
        while stack:
            n, done = stack.pop()
            if done:
                exit_of[n] = len(order) - 1  # last pre-order id inside n's subtree
                continue
            order.append(n)
            stack.append((n, True))
            for c in reversed(children[n]):
                stack.append((c, False))
    if len(order) != len(parents):
        raise ValueError("parent list has a cycle")
    token_node: list[int] = []
    token_exit: list[int] = []
    for pre_id, n in enumerate(order):
        token_node += [pre_id] * lengths[n]
        token_exit += [exit_of[n]] * lengths[n]
    return token_node, token_exit
