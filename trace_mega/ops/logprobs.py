"""Per-token log-probs (and entropy) of the generated tokens of packed rollout trees.

In the packed stream (docs/PACKING.md) the token that precedes stream token i
on its own root-to-leaf path sits at `prev_index[i]`, so the logits that
predict token i are the output layer applied to `hidden[prev_index[i]]`:

    logprob[i] = z[prev_index[i], tokens[i]] - logsumexp_v z[prev_index[i], v]
    entropy[i] = -sum_v p[prev_index[i], v] log p[prev_index[i], v]
    z[j, v]    = (hidden[j] . W[v]) / temperature

computed only for the selected tokens (default: the loss mask). A branch
point's last token predicts the first token of every child, so its hidden row
is gathered several times and its gradient is the sum over the children (the
backward of `index_select`), exactly as if each path were a separate row.

The log-softmax is the fused kernel `trace_mega.kernels.token_logprobs`: it
never materialises [T, V] logits, and with `tp_group` each rank holds only its
vocab shard `W` = rows [vocab_start, vocab_start + V_local) and the statistics
are combined with one all-gather of (4, T) floats (never the logits).
`hidden` must be the full (T, H) stream on every TP rank (gather a
sequence-parallel hidden first).

`flat_token_logprobs` is the same quantity for the one-row-per-path layout
(`FlatPaths`), the baseline that the packed layout must reproduce.
"""

from __future__ import annotations

from typing import Optional

import torch

from trace_mega.kernels.token_logprobs import token_logprobs
from trace_mega.rollout.tree import FlatPaths, PackedTrees

__all__ = ["packed_token_logprobs", "flat_token_logprobs"]


def _scatter(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """(size,) fp32 zeros with `values` placed at `index` (differentiable)."""
    out = values.new_zeros(size)
    return out.index_copy(0, index, values)


def packed_token_logprobs(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    packed: PackedTrees,
    *,
    mask: Optional[torch.Tensor] = None,
    tp_group=None,
    vocab_start: int = 0,
    with_entropy: bool = False,
    temperature: float = 1.0,
    backend: str = "auto",
    reduce_grad_hidden: bool = True,
    vocab_size: Optional[int] = None,
):
    """Log-prob of every selected stream token under the logits at its `prev_index`.

    Args:
        hidden: (T, H) final hidden states of the packed stream (after the final norm).
        output_weight: (V_local, H) output-layer weight (this rank's vocab shard with `tp_group`).
        packed: the stream (`tokens`, `prev_index`, `loss_mask` are used).
        mask: (T,) bool tokens to score; default `packed.loss_mask`. Tokens with
            `prev_index < 0` (a tree's first token) have no predicting position and get 0.
        tp_group, vocab_start: vocab-parallel shard of `output_weight` (see the kernel).
        with_entropy: also return the entropy of each selected token's predictive distribution.
        temperature: logits are divided by it (use the sampling temperature for PPO ratios).
        backend: forwarded to the kernel ("auto" | "triton" | "torch").
        reduce_grad_hidden: all-reduce the hidden gradient over `tp_group` in the kernel's
            backward. Pass False when `hidden` came through a Megatron region whose backward
            already sums over TP (the sequence-parallel gather of `TreeGPTModel`), or the
            gradient is counted once per rank.
        vocab_size: the true (unpadded) vocabulary: rows of `output_weight` at global ids >=
            vocab_size (the TP padding) are left out of the softmax and get no gradient.

    Returns:
        logprobs (T,) fp32, 0 on unselected tokens; and entropy (T,) fp32 with `with_entropy`.
    """
    T = packed.num_tokens
    if hidden.dim() != 2 or hidden.shape[0] != T:
        raise ValueError(f"hidden must be (T={T}, H), got {tuple(hidden.shape)}")
    prev = packed.prev_index.to(hidden.device)
    sel_mask = packed.loss_mask if mask is None else mask
    sel_mask = sel_mask.to(hidden.device) & (prev >= 0)
    sel = torch.nonzero(sel_mask).squeeze(1)  # (M,) one host sync: the kernel needs M
    rows = hidden.index_select(0, prev.index_select(0, sel))  # (M, H)
    targets = packed.tokens.to(hidden.device).index_select(0, sel)  # (M,)
    out = token_logprobs(
        rows,
        output_weight,
        targets,
        tp_group=tp_group,
        vocab_start=vocab_start,
        with_entropy=with_entropy,
        temperature=temperature,
        backend=backend,
        reduce_grad_hidden=reduce_grad_hidden,
        vocab_size=vocab_size,
    )
    if not with_entropy:
        return _scatter(out, sel, T)
    lp, ent = out
    return _scatter(lp, sel, T), _scatter(ent, sel, T)


def flat_token_logprobs(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    flat: FlatPaths,
    *,
    tp_group=None,
    vocab_start: int = 0,
    with_entropy: bool = False,
    temperature: float = 1.0,
    backend: str = "auto",
    vocab_size: Optional[int] = None,
):
    """The same log-probs for the one-row-per-path layout: row b, column s is predicted at s - 1.

    Args:
        hidden: (L, S, H) hidden states of the right-padded rows of `flat`.
    Returns:
        logprobs (L, S) fp32, 0 where `flat.loss_mask` is False and at s = 0;
        and entropy (L, S) with `with_entropy`.
    """
    L, S = flat.tokens.shape
    if hidden.shape[:2] != (L, S):
        raise ValueError(f"hidden must be (L={L}, S={S}, H), got {tuple(hidden.shape)}")
    sel_mask = flat.loss_mask.to(hidden.device).clone()
    sel_mask[:, 0] = False  # a row's first token has no predicting position
    sel = torch.nonzero(sel_mask.reshape(-1)).squeeze(1)  # (M,) flat index b * S + s
    rows = hidden.reshape(L * S, -1).index_select(0, sel - 1)  # (M, H): position s - 1
    targets = flat.tokens.to(hidden.device).reshape(-1).index_select(0, sel)
    out = token_logprobs(
        rows,
        output_weight,
        targets,
        tp_group=tp_group,
        vocab_start=vocab_start,
        with_entropy=with_entropy,
        temperature=temperature,
        backend=backend,
        vocab_size=vocab_size,
    )
    if not with_entropy:
        return _scatter(out, sel, L * S).view(L, S)
    lp, ent = out
    return _scatter(lp, sel, L * S).view(L, S), _scatter(ent, sel, L * S).view(L, S)
