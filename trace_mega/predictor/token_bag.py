"""A prompt's success logit from its words alone: the value head's bag of tokens (`predictor.root_token_bag`).

The policy's state at a prompt's last token is shaped to predict the next token, so it need not carry
what makes the prompt hard. The bag reads the prompt's tokens themselves:

* features: every token, and with `root_bag_pair_buckets` every adjacent pair of tokens, hashed into that
  many buckets. A single token cannot tell ``ice 9`` from ``start 9``; the pair can.
* `root_bag_hidden_size` 0: a learned logit per feature, summed (linear in the features).
  Above 0: a learned embedding of that width per feature, summed, through ReLU and a linear layer, so the
  logit can depend on two features together (a goal's distance from the start is such an interaction).

It starts at exactly 0 (the zero table, or the zero output layer), so an untrained bag leaves the head's
prediction as it is. The embedding's start is random but fixed (a generator of its own, seed 0): every
data-parallel rank builds the same bag.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trace_mega.rollout.tree import PackedTrees


class PromptTokenBag(nn.Module):
    """(S,) logits of nodes of a packed batch from their tokens (and adjacent token pairs)."""

    def __init__(self, vocab_size: int, pair_buckets: int = 0, hidden_size: int = 0) -> None:
        super().__init__()
        self.vocab_size, self.pair_buckets = vocab_size, pair_buckets
        rows, width = vocab_size + pair_buckets, hidden_size or 1
        if hidden_size:
            gen = torch.Generator().manual_seed(0)
            # std 1/sqrt(width): a prompt's ~10-30 features sum to a state of order 1 per unit.
            self.table = nn.Parameter(torch.randn(rows, width, generator=gen) / width**0.5)
            self.out = nn.Linear(hidden_size, 1)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)
        else:
            self.table = nn.Parameter(torch.zeros(rows, 1))
            self.out = None

    def forward(self, packed: PackedTrees, nodes: torch.Tensor) -> torch.Tensor:
        ids, offsets = self.features(packed, nodes)
        dev = self.table.device
        bags = F.embedding_bag(ids.to(dev), self.table, offsets.to(dev), mode="sum")  # (S, width)
        return bags.view(-1) if self.out is None else self.out(torch.relu(bags)).view(-1)

    def features(self, packed: PackedTrees, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(F,) feature ids of `nodes` (S,) concatenated, and (S,) the offset of each node's: its tokens,
        then (with pair buckets) `vocab_size + (a * vocab_size + b) % pair_buckets` for each adjacent
        pair (a, b) inside the node (collision-free while pair_buckets >= vocab_size²)."""
        nodes = nodes.cpu()
        start, end = packed.node_start[nodes], packed.node_end[nodes]  # (S,) stream ranges
        lens = end - start
        owner = torch.repeat_interleave(torch.arange(nodes.numel()), lens)
        pos = torch.arange(int(lens.sum())) + (start - (lens.cumsum(0) - lens))[owner]  # (Σ lens,) stream
        tok = packed.tokens[pos].long()
        if not self.pair_buckets:
            return tok, lens.cumsum(0) - lens
        # a pair starts at every token but a node's last: tok[i], tok[i + 1] of the same owner
        has_next = torch.ones_like(tok, dtype=torch.bool)
        has_next[(lens.cumsum(0) - 1)[lens > 0]] = False
        i = torch.nonzero(has_next).flatten()
        pairs = self.vocab_size + (tok[i] * self.vocab_size + tok[i + 1]) % self.pair_buckets
        ids = torch.cat([tok, pairs])
        key = torch.cat([owner, owner[i]])  # group every node's features together, node by node
        order = torch.sort(key, stable=True).indices
        counts = torch.bincount(key, minlength=nodes.numel())
        return ids[order], counts.cumsum(0) - counts
