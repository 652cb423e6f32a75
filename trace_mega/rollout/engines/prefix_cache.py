"""The torch engine's prefix KV cache: per-sequence KV in an LRU store, looked up by the longest
common token prefix through a token trie (docs/engines.md, "Prefix KV cache")."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (key, value) of one sequence, each [kv_heads, seq, head_dim] (post-RoPE, as HF caches them)."""


@dataclass
class CacheEntry:
    tokens: np.ndarray
    """[L] int64 token ids whose KV is held."""
    kv: KV
    eid: int = -1
    """Insertion number (orders batches reproducibly: a memory address would differ per process)."""
    routes: Optional[torch.Tensor] = None
    """With routing capture: [L, MoE layers, top-k] experts of the tokens, as first computed."""


class _TrieNode:
    """One token position shared by the stored sequences that pass through it."""

    __slots__ = ("children", "eids", "end")

    def __init__(self) -> None:
        self.children: dict[int, "_TrieNode"] = {}
        self.eids: set[int] = set()
        """Entries whose tokens pass through (or end at) this node."""
        self.end: Optional[int] = None
        """The entry whose tokens end exactly here (at most one: an identical insert is covered)."""


class PrefixKVCache:
    """LRU store of per-sequence KV, looked up by the longest common token prefix.

    Causal attention makes the KV of a sequence's first n tokens depend on
    those tokens only, so any stored sequence serves every request that shares
    a prefix with it. A new sequence replaces stored sequences it extends;
    eviction drops least-recently-used sequences until at most `max_tokens`
    tokens are held.

    The stored token sequences form a trie, so a lookup or an insert costs
    O(its length) whatever the number of stored sequences (a scan over every
    stored sequence was the rollout's largest host cost with a few hundred
    episodes in flight). Among the sequences sharing the longest prefix, a
    lookup returns the most recently used.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: "OrderedDict[int, CacheEntry]" = OrderedDict()
        self._used: dict[int, int] = {}
        """Entry id -> recency stamp (larger: used later); orders ties inside one trie node."""
        self._clock = 0
        self._root = _TrieNode()
        self._next_id = 0
        self.tokens_held = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _touch(self, eid: int) -> None:
        self._entries.move_to_end(eid)
        self._clock += 1
        self._used[eid] = self._clock

    def lookup(self, tokens: Sequence[int]) -> tuple[Optional[CacheEntry], int]:
        """The entry sharing the longest prefix with `tokens` and that length (0 and None: no hit)."""
        node, depth = self._root, 0
        for t in _ints(tokens):
            child = node.children.get(t)
            if child is None:
                break
            node, depth = child, depth + 1
        if depth == 0:
            return None, 0
        eid = max(node.eids, key=self._used.__getitem__)
        self._touch(eid)
        return self._entries[eid], depth

    def insert(self, tokens: Sequence[int], kv: KV, routes: Optional[torch.Tensor] = None) -> None:
        toks = _ints(tokens)
        n = len(toks)
        if n == 0 or n > self.max_tokens:
            return
        node, extended = self._root, []
        for t in toks:
            node = node.children.get(t)
            if node is None:
                break
            if node.end is not None:  # a stored sequence the new one extends
                extended.append(node.end)
        else:  # already covered by a sequence that extends this one (the least recently used)
            self._touch(min(node.eids, key=self._used.__getitem__))
            return
        for eid in extended:
            self._remove(eid)
        eid, node = self._next_id, self._root
        self._next_id += 1
        for t in toks:
            node = node.children.setdefault(t, _TrieNode())
            node.eids.add(eid)
        node.end = eid
        self._entries[eid] = CacheEntry(np.asarray(toks, dtype=np.int64), kv, eid, routes)
        self._touch(eid)
        self.tokens_held += n
        while self.tokens_held > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        del self._used[eid]
        self.tokens_held -= entry.tokens.size
        node = self._root
        for t in entry.tokens.tolist():
            child = node.children[t]
            child.eids.discard(eid)
            if not child.eids:  # no other sequence below: drop the whole branch
                del node.children[t]
                return
            node = child
        node.end = None

    def clear(self) -> None:
        self._entries.clear()
        self._used.clear()
        self._root = _TrieNode()
        self.tokens_held = 0


def _ints(tokens: Sequence[int]) -> Sequence[int]:
    """Token ids as trie keys: a list as it is, an array as Python ints (numpy scalars hash and
    compare equal to ints, only slower)."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
