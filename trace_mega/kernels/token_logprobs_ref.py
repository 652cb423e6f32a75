"""PyTorch reference of `token_logprobs`: `log_softmax(hidden @ weight.T / temperature).gather(targets)`.

It materialises the (T, V) fp32 logits and their log-softmax (and, in the backward,
their gradients): the ground truth of the kernel's tests and the baseline of
benchmarks/bench_token_logprobs.py. Never used for training.
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs_reference"]


def token_logprobs_reference(hidden, weight, targets, *, with_entropy=False, temperature=1.0):
    """`log_softmax(hidden @ weight.T / temperature).gather(targets)`, fully materialised.

    The matmul runs in the inputs' dtype (as a model's output layer does), the
    log-softmax in fp32. Negative targets give logprob 0 / entropy 0. Single shard only
    (weight holds the whole vocabulary). Returns fp32 (T,) [and entropy (T,)].
    """
    logits = (hidden @ weight.t()).float()  # (T, V) fp32 (no copy for fp32 inputs)
    if temperature != 1.0:  # skip the extra (T, V) copy in the common case
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # (T, V)
    valid = targets >= 0
    lp = logp.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    if not with_entropy:
        return lp
    ent = -(logp.exp() * logp).sum(-1)
    ent = torch.where(valid, ent, torch.zeros_like(ent))
    return lp, ent
