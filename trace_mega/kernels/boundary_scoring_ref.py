"""PyTorch reference of `boundary_scoring`: the value head at turn-boundary positions, unfused.

    logit[p] = hidden[positions[p]] . w + b,   score[p] = sigmoid(logit[p])   (fp32)

Plain gather + matmul + sigmoid under autograd: it materialises the gathered (P, H)
rows. It is the ground truth of the kernel's tests, the "unfused" baseline of
benchmarks/bench_boundary_scoring.py, and the kernel's own ``backend="torch"`` path
(a CPU without the interpreter, or too many positions for it).
"""

from __future__ import annotations

import torch

__all__ = ["boundary_scores_reference"]


def boundary_scores_reference(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    return_logits: bool = False,
):
    """`sigmoid(hidden[positions] @ w + b)` in fp32: hidden (T, H), positions (P,) int,
    weight (H,) or (1, H), bias a one-element tensor or None. Returns scores (P,) [and logits (P,)]."""
    logits = hidden[positions].float() @ weight.reshape(-1).float()  # (P,)
    if bias is not None:
        logits = logits + bias.reshape(()).float()
    scores = torch.sigmoid(logits)
    return (scores, logits) if return_logits else scores
