"""MoE routing capture for rollout routing replay (R3; docs/learner.md, "MoE routing replay").

The rollout engine routes every token to its top-k experts in every MoE layer with its own
numerics; the learner replays those choices (trace_mega/learner/routing_replay.py) so the
log-probs it trains on come from the experts the engine sampled from.

* `RoutingRecorder(model)`: forward hooks on the routers of a transformers Qwen3-MoE
  (`Qwen3MoeTopKRouter`, whose forward returns (logits, weights, top-k indices)); it records the
  top-k expert ids of every token a forward computes, and hands them to the torch engine's rows:
  `assign_prefill` (each row's whole prefix: the cached part's routes from the cache entry that
  first computed them, the prefilled suffix from this forward) and `assign_decode` (one token per
  row). Routes are stored compactly (`route_dtype`: uint8 up to 255 experts, else int16).
* `NO_ROUTE`: the value of a token the engine never routed (e.g. a trajectory's last token,
  never fed back to the model); the learner routes such tokens itself.
* `extend_routes` / `attach_routes`: the agent loop keeps each episode's path routes (every
  request's routes cover its prompt and its generated tokens but the last), then splits them over
  the tree nodes of that path, each token's routes stored once, on the node that holds it;
  `packed_routes(trees, packed, ...)` lays them out in the packed stream order: (T, L, k) int16.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = [
    "NO_ROUTE",
    "route_dtype",
    "RoutingRecorder",
    "routers_of",
    "extend_routes",
    "attach_routes",
    "packed_routes",
]

NO_ROUTE = -1
"""Expert id of a token the engine did not route (after `as_index`; stored as the dtype's sentinel)."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype holding expert ids 0..num_experts-1 and a sentinel: uint8 (255) or int16 (-1)."""
    return torch.uint8 if num_experts < 255 else torch.int16


def _sentinel(dtype: torch.dtype) -> int:
    return 255 if dtype == torch.uint8 else -1


def as_index(routes: torch.Tensor) -> torch.Tensor:
    """Stored routes as int64 expert ids, `NO_ROUTE` where the engine routed nothing."""
    out = routes.long()
    return out.masked_fill(out == _sentinel(routes.dtype), NO_ROUTE)


def routers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers MoE model, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RoutingRecorder:
    """Records the top-k experts every router of an HF MoE model picks, per forward.

    Each hook keeps its layer's (N, k) indices of the latest forward (N = batch x sequence,
    row-major, the router's flattened input); `take()` returns them stacked as (N, L, k).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        routers = routers_of(model)
        if not routers:
            raise ValueError("routing capture needs an MoE model (no top-k router found)")
        self.num_layers = len(routers)
        self.topk = int(routers[0].top_k)
        self.dtype = route_dtype(int(routers[0].num_experts))
        self._latest: list[Optional[torch.Tensor]] = [None] * self.num_layers
        for i, router in enumerate(routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self._latest[layer] = output[2].detach()  # (N, k) top-k expert ids

        return hook

    def take(self) -> torch.Tensor:
        """(N, L, k) routes of the latest forward on the CPU (compact dtype); clears them."""
        if any(t is None for t in self._latest):
            raise RuntimeError("routing capture: a forward did not reach every MoE router")
        out = torch.stack(self._latest, dim=1).to("cpu", self.dtype)  # type: ignore[arg-type]
        self._latest = [None] * self.num_layers
        return out

    def empty(self, n: int = 0) -> torch.Tensor:
        """(n, L, k) routes of tokens the engine did not route."""
        return torch.full((n, self.num_layers, self.topk), _sentinel(self.dtype), dtype=self.dtype)

    def assign_prefill(self, rows: Sequence[Any], suffix_width: int) -> None:
        """After a prefill of `rows` (suffixes right-aligned in `suffix_width` columns): each row's
        `routes` become its whole prefix's, the cached part from its source entry (routed when
        those tokens were first computed), the rest from this forward."""
        step = self.take().view(len(rows), suffix_width, self.num_layers, self.topk)
        for b, r in enumerate(rows):
            n = len(r.prefix) - r.reuse
            cached = r.source.routes[: r.reuse] if r.source is not None else self.empty()
            if cached.shape[0] != r.reuse:
                raise RuntimeError("routing capture: a cached prefix holds no routes (cache filled without capture)")
            r.routes = [cached, step[b, suffix_width - n :]]

    def assign_decode(self, rows: Sequence[Any]) -> None:
        """After a decode forward: each row's fed token's routes (row j is batch row j)."""
        step = self.take()  # (B, L, k)
        for j, r in enumerate(rows):
            r.routes.append(step[j : j + 1])

    @staticmethod
    def joined(row: Any) -> torch.Tensor:
        """(len, L, k) every routed token of `row` so far, in order."""
        return torch.cat(row.routes) if len(row.routes) > 1 else row.routes[0]


def extend_routes(old: Optional[torch.Tensor], new: Optional[torch.Tensor], kept: int) -> Optional[torch.Tensor]:
    """An episode's path routes after its next request: `old` (the earlier requests' rows, kept as
    first computed) followed by `new`'s later rows, cut at the `kept` tokens of the path the
    request leaves (its prompt and the generated tokens the agent loop kept)."""
    if new is None:
        return old
    new = new[:kept]
    return new if old is None else torch.cat([old, new[old.shape[0] :]])


def attach_routes(tree: Any, leaf: int, routes: torch.Tensor) -> None:
    """Store a request's routes on the nodes of the path root..`leaf` of `tree`.

    `routes` (n, L, k) covers the path's first n tokens (a completion's: its prompt and its
    generated tokens but the last). Each node keeps (len(node), L, k) routes in `node.routing`;
    a row already routed (the first request that computed a shared prefix) is kept, so each
    token's routes are stored once and the learner replays what that first request used.
    """
    start = 0
    for nid in tree.path(leaf):
        node = tree.nodes[nid]
        n = len(node.token_ids)
        have = node.routing
        if have is None:
            have = torch.full((n, *routes.shape[1:]), _sentinel(routes.dtype), dtype=routes.dtype)
        part = routes[start : start + n]
        fresh = (have[: part.shape[0]] == _sentinel(routes.dtype)).all(-1).all(-1)  # (len(part),)
        have[: part.shape[0]][fresh] = part[fresh]
        node.routing = have
        start += n


def packed_routes(trees: Sequence[Any], packed: Any, num_layers: int, topk: int) -> torch.Tensor:
    """(T, L, k) int16 routes of every token of `packed` (the layout of `trees`), `NO_ROUTE` where
    a node holds none (int16: a step's routes stay small in host memory; the learner widens them
    per forward)."""
    out = torch.full((packed.num_tokens, num_layers, topk), NO_ROUTE, dtype=torch.int16)
    for g, (ti, lid) in enumerate(packed.node_local):
        routing = trees[ti].nodes[lid].routing
        if routing is not None:
            s, e = int(packed.node_start[g]), int(packed.node_end[g])
            out[s:e] = as_index(routing[: e - s]).to(torch.int16)
    return out
