"""Rollout routing replay (R3) in the Megatron-Core learner (docs/learner.md, "MoE routing replay").

The rollout engine records which experts every token was routed to in every MoE layer
(trace_mega/rollout/engines/routing.py); here the policy's routers take those experts instead
of their own top-k, so the log-probs the loss sees are those of the experts the engine sampled
from. The router's probabilities are still the policy's own scores at the replayed experts
(gradients flow into the router weights).

megatron-core 0.16 calls `router.router_replay.get_replay_topk(scores, topk, ...)` from its top-k
routing (`topk_routing_with_score_function`) whenever a router has one. Its own `RouterReplay`
keeps every instance in one class-level list shared by all models of the process, so the frozen
reference (which routes on its own) and earlier models would share or consume the policy's
replay data; `install` instead gives each of the policy's routers its own `RouteReplay`, which
implements the same hook.

* `install(net)`: per-layer `RouteReplay`s on this pipeline stage's MoE routers (a stage only has
  its own layers), kept as `net.route_replays` {global layer index: replay}.
* `replaying(net, routing, length)`: context for one forward: routing `(B=1, S, L, k)` int16 on
  the host (the whole model's layers; `NO_ROUTE` rows route on their own: tokens the engine never
  fed, padding). Each layer gets its slice in the router's token order: the layer sees [S/tp, B]
  tokens, this TP rank's contiguous sequence block under sequence parallelism, else all S.
* Activation recompute (`parallel.recompute_activations`): megatron runs each layer's forward
  again in backward, outside `replaying`. A loss forward therefore also queues each layer's
  routes, and the router takes the oldest queued routes when it runs inside megatron's checkpoint
  with grad enabled (the recompute; its first forward runs there under no_grad). Backward visits
  the micro-batches in forward order under every schedule here (1F1B included), so a FIFO per
  layer pairs them; `take_metrics` fails if a queued recompute never ran.
* `RouteReplay` counts, in grad-enabled forwards (the loss's; under recompute, its recompute), the
  token-layer routes replayed and those where the policy's own top-k would have picked the same
  experts; `take_metrics` reduces them over all ranks: `moe/replay_agreement`,
  `moe/replayed_tokens`.
* The replay probe (`model.moe_replay_probe`): the learner also runs the step's batch routing on its
  own, under the same weights, and `own_routing_sums` compares those log-probs with the engine's on
  the same loss tokens; `own_routing_metrics` gives `moe/own_routing_k3` next to `mismatch/k3`, so
  replay's effect is measured on identical tokens, not across two diverging runs.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import is_checkpointing

from trace_mega.objective.losses import LOG_RATIO_CLAMP
from trace_mega.rollout.engines.routing import NO_ROUTE

__all__ = [
    "RouteReplay",
    "install",
    "replaying",
    "take_metrics",
    "pad_routes",
    "own_routing_sums",
    "own_routing_metrics",
]


class RouteReplay:
    """One MoE layer's replay, called by megatron-core's top-k routing in place of its top-k."""

    def __init__(self) -> None:
        self.target: Optional[torch.Tensor] = None
        """(N, k) int64 experts for the router's N tokens of the current forward, or None (own routing)."""
        self.recomputes: deque[torch.Tensor] = deque()
        """Targets of loss forwards whose layer megatron recomputes in backward, oldest first."""
        self.agreed = torch.zeros((), dtype=torch.long)
        """Replayed token routes whose expert set equals the router's own top-k (grad-enabled forwards)."""
        self.replayed = torch.zeros((), dtype=torch.long)
        """Token routes replayed (grad-enabled forwards)."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        default_compute_topk: Optional[Callable] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (N, k), experts (N, k)): the replayed experts where a route is given, the router's
        own top-k elsewhere; values are the router's scores at those experts (differentiable)."""
        own_values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target
        if target is None and self.recomputes and torch.is_grad_enabled() and is_checkpointing():
            target = self.recomputes.popleft()  # the backward's recompute of a replayed forward
        if target is None:
            return own_values, own
        if target.shape != own.shape:
            raise RuntimeError(
                f"routing replay: {tuple(target.shape)} routes for a router that sees {tuple(own.shape)} "
                "(the routes are not in the router's token order)"
            )
        given = target[:, :1] >= 0  # (N, 1): the engine routed this token
        experts = torch.where(given, target, own)
        if torch.is_grad_enabled():
            with torch.no_grad():
                same = (own.sort(-1).values == experts.sort(-1).values).all(-1) & given[:, 0]
                self.agreed = self.agreed.to(scores.device) + same.sum()
                self.replayed = self.replayed.to(scores.device) + given.sum()
        return scores.gather(1, experts), experts


def install(net: torch.nn.Module) -> dict[int, RouteReplay]:
    """Give every MoE router of `net` (a `TreeGPTModel` stage) its own `RouteReplay`."""
    if net.config.moe_router_fusion:
        # The fused top-k kernel never calls the replay hook: replay would silently do nothing.
        raise ValueError("routing replay needs moe_router_fusion off (the fused router bypasses the replay hook)")
    replays = {}
    for layer in net.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            replays[layer.layer_number - 1] = router.router_replay = RouteReplay()
    net.route_replays = replays
    return replays


def pad_routes(routes: torch.Tensor, length: int) -> torch.Tensor:
    """(T, L, k) routes padded with `NO_ROUTE` rows to `length` tokens."""
    return F.pad(routes, (0, 0, 0, 0, 0, length - routes.shape[0]), value=NO_ROUTE)


@contextmanager
def replaying(net: torch.nn.Module, routing: Optional[torch.Tensor], length: int) -> Iterator[None]:
    """Replay `routing` (B=1, S, L, k) in `net`'s MoE layers for one forward of `length` >= S tokens
    (the sequence as the decoder sees it: padded for sequence parallelism; pads route on their own).
    A model without replays installed (the reference) or no routing: nothing changes."""
    replays: dict[int, RouteReplay] = getattr(net, "route_replays", {})
    if routing is None or not replays:
        yield
        return
    if routing.shape[0] != 1:
        raise ValueError("routing replay: packed micro-batches have batch size 1")
    routes = pad_routes(routing[0], length)  # (S_pad, L, k), int16 on the host
    if net.config.sequence_parallel:  # each TP rank routes its own contiguous block of the sequence
        tp = net.pg_collection.tp
        block = routes.shape[0] // tp.size()
        routes = routes[tp.rank() * block : (tp.rank() + 1) * block]
    # A loss forward under full recompute: its backward runs every layer's forward again.
    recomputed = net.config.recompute_granularity == "full" and net.training and torch.is_grad_enabled()
    try:
        device = next(net.parameters()).device
        for layer, replay in replays.items():  # (S_local, k) int64 (gather's index): B=1, [s, b] flattens to s
            replay.target = routes[:, layer].to(device, torch.long)
            if recomputed:
                replay.recomputes.append(replay.target)
        yield
    finally:
        for replay in replays.values():
            replay.target = None


def take_metrics(
    nets: list[torch.nn.Module], num_layers: int, device: torch.device, group: Optional[dist.ProcessGroup] = None
) -> dict[str, float]:
    """`moe/replay_agreement` (share of replayed token-layer routes the policy's own router would
    have chosen too) and `moe/replayed_tokens` (replayed token routes / the model's `num_layers` MoE
    layers), over the grad-enabled forwards since the last call, summed over the ranks of `group`
    (collective; each token-layer route is routed on exactly one rank: TP ranks hold disjoint
    sequence blocks, PP stages disjoint layers, DP ranks disjoint trees); resets the counts."""
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for net in nets:
        for layer, replay in getattr(net, "route_replays", {}).items():
            if replay.recomputes:
                raise RuntimeError(
                    f"routing replay: layer {layer} kept {len(replay.recomputes)} routes for a backward "
                    "recompute that never ran (the recompute would have routed on its own)"
                )
            counts += torch.stack([replay.agreed.to(device), replay.replayed.to(device)]).double()
            replay.agreed, replay.replayed = torch.zeros_like(replay.agreed), torch.zeros_like(replay.replayed)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    agreed, replayed = counts.tolist()
    return {
        "moe/replay_agreement": agreed / replayed if replayed else float("nan"),
        "moe/replayed_tokens": replayed / num_layers,
    }


_OWN = "own_routing_"


def own_routing_sums(own_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for `own_routing_metrics` over one micro-batch: (T,) learner log-probs with the policy
    routing on its own, (T,) the engine's, (T,) bool loss mask; tokens where either is not finite are
    left out (as in `objective.mismatch`)."""
    lp_o, lp_e = own_lp.detach().double(), engine_lp.detach().double()
    ok = mask.to(lp_o.device) & torch.isfinite(lp_o) & torch.isfinite(lp_e)
    x = torch.where(ok, lp_o - lp_e.to(lp_o.device), 0.0)  # (T,) log ratio, 0 where left out
    xc = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        f"{_OWN}tokens_sum": ok.sum().double(),
        f"{_OWN}k3_sum": (torch.exp(xc) - 1.0 - xc).sum(),  # 0 where left out
        f"{_OWN}abs_sum": x.abs().sum(),
        f"{_OWN}logprob_abs_max": x.abs().max() if x.numel() else x.sum(),
    }


def own_routing_metrics(total: dict[str, float]) -> dict[str, float]:
    """Pops the `own_routing_sums` keys from `total` (summed over micro-batches, ranks and optimiser
    steps): `moe/own_routing_k3` (k3 KL between the engine and the learner routing on its own: what
    `mismatch/k3` would be without replay), `moe/own_routing_logprob_mismatch` (mean |Δ log-prob|,
    beside `loss/logprob_mismatch`) and `moe/own_routing_logprob_abs_max`; {} when the probe did not run."""
    s = {k.removeprefix(_OWN): total.pop(k) for k in [k for k in total if k.startswith(_OWN)]}
    if not s:
        return {}
    t = max(s["tokens_sum"], 1.0)
    return {
        "moe/own_routing_k3": s["k3_sum"] / t,
        "moe/own_routing_logprob_mismatch": s["abs_sum"] / t,
        "moe/own_routing_logprob_abs_max": s["logprob_abs_max"],
    }
