"""TRACE-C turn credit from reference-probe log-probs (docs/design.md §4): the pure math.

Boundaries and turns of one trajectory x, n_0, n_1, …, n_{T-1} (T turns):
    S_0 = the prompt; S_k = after turn n_{k-1} (the k-th tool call and its observation).
A boundary follows every turn except a final-answer turn, so a trajectory ending in an
answer has K = T − 1 boundaries after the prompt (K + 1 probes ℓ̄_0 … ℓ̄_K) and one
cut off without an answer (its last turn a tool call or an error) has K = T.

    ℓ̄_k     = (1/|y*|) Σ_t log π_ref(y*_t | S_k, template, y*_{<t})    (probe.py)
    d_k     = −ℓ̄_k + ε                       (likelihood gap of the gold answer, > 0)
    V(S_k)  = log(d_0 / d_k)                  (share of the initial gap closed)
    δ_k     = V(S_{k+1}) − V(S_k) = log(d_k / d_{k+1}),   k = 0 … K−1
    R_k     = Σ_{j=0}^{h−1} γ_td^j δ_{k+j}    (h = `lookahead_turns`, terms with k+j ≥ K dropped)

Turn k (0-based; it starts from S_k) is the transition S_k → S_{k+1}, so it earns δ_k and,
discounted, the δ of the next h − 1 turns. The final-answer turn has index K: no
boundary follows it, so R_K = 0 by the truncation. Mixing with the outcome advantage
A^out of the trajectory (`CreditConfig.mixing`; "auto" picks broadcast under the tree outcome
term, anchored otherwise, advantages.resolve_mixing):
    anchored (the paper's rule):  A_k = β R_k for k < T−1,   A_{T−1} = β R_{T−1} + A^out
    broadcast:                    A_k = A^out + β R_k for every turn
Under anchored the answer turn gets exactly A^out (its R is 0); a trajectory cut off
after a tool call gets that call's credit plus A^out on its last turn. Turn credit is
never normalised across the prompt group.

On a rollout tree a shared node lies on several root-to-leaf paths, and its R depends
on the path below it (look-ahead). `node_turn_credit` gives it the mean over the
leaves below it of the per-path R; with the `per_leaf` token weight (leaf count) the
packed loss's linear term then equals training on every path separately.
"""

from __future__ import annotations

from typing import Literal

import torch

from trace_mega.rollout.tree import PackedTrees

__all__ = [
    "likelihood_gaps",
    "state_values",
    "td_rewards",
    "lookahead_returns",
    "trajectory_turn_credit",
    "mix_turn_advantages",
    "path_nodes",
    "node_td_rewards",
    "node_turn_credit",
]


def likelihood_gaps(ell: torch.Tensor, epsilon: float) -> torch.Tensor:
    """d_k = −ℓ̄_k + ε (same shape as `ell`)."""
    if epsilon <= 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    return -ell + epsilon


def state_values(ell: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(…, K+1) V(S_k) = log((−ℓ̄_0 + ε) / (−ℓ̄_k + ε)); V(S_0) = 0."""
    d = likelihood_gaps(ell, epsilon)
    return torch.log(d[..., :1] / d)


def td_rewards(ell: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(…, K) δ_k = log(d_k / d_{k+1}) from (…, K+1) probes."""
    d = likelihood_gaps(ell, epsilon)
    return torch.log(d[..., :-1] / d[..., 1:])


def lookahead_returns(delta: torch.Tensor, gamma: float, horizon: int) -> torch.Tensor:
    """(…, K) R_k = Σ_{j=0}^{horizon−1} γ^j δ_{k+j}, truncated at the last δ (zeros beyond it count 0)."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    K = delta.shape[-1]
    out = delta.clone()
    for j in range(1, min(horizon, K)):
        out[..., : K - j] += (gamma**j) * delta[..., j:]
    return out


def trajectory_turn_credit(
    ell: torch.Tensor, num_turns: int, epsilon: float, gamma: float, horizon: int
) -> torch.Tensor:
    """(num_turns,) R_k of every turn of one trajectory from its K+1 probes (K ≤ num_turns).

    Turns k ≥ K (the final-answer turn) have no boundary after them and get 0.
    """
    K = ell.shape[-1] - 1
    if not 0 <= K <= num_turns:
        raise ValueError(f"{K + 1} probes need between {K} and {K + 1} turns, got {num_turns}")
    R = ell.new_zeros(num_turns)
    R[:K] = lookahead_returns(td_rewards(ell, epsilon), gamma, horizon)
    return R


def mix_turn_advantages(
    credit: torch.Tensor,
    outcome: torch.Tensor,
    is_final: torch.Tensor,
    mode: Literal["anchored", "broadcast"],
    beta: float,
) -> torch.Tensor:
    """Per-turn advantage from turn credit R and the outcome advantage A^out (module docstring).

    `credit`, `outcome`, `is_final` broadcast together (per turn of one trajectory or per
    tree node); `is_final` marks the last turn of a trajectory (a leaf).
    """
    if mode == "anchored":
        return beta * credit + torch.where(is_final, outcome, torch.zeros_like(outcome))
    if mode == "broadcast":
        return outcome + beta * credit
    raise ValueError(f"unknown credit mixing {mode!r}; valid: anchored, broadcast")


def path_nodes(packed: PackedTrees) -> torch.Tensor:
    """(L, D+1) global node id at each depth of every root-to-leaf path, −1 beyond the leaf."""
    leaves = packed.leaf_nodes
    D = int(packed.node_depth.max()) if packed.num_nodes else 0
    out = torch.full((leaves.numel(), D + 1), -1, dtype=torch.long, device=leaves.device)
    rows = torch.arange(leaves.numel(), device=leaves.device)
    anc = leaves.clone()
    for _ in range(D + 1):  # one ancestor per step, all paths at once
        live = anc >= 0
        out[rows[live], packed.node_depth[anc[live]]] = anc[live]
        anc = torch.where(live, packed.node_parent[anc.clamp(min=0)], anc)
    return out


def node_td_rewards(packed: PackedTrees, node_ell: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(N,) δ of every turn node: log(d_parent / d_node) where the node has a boundary (finite ℓ̄), else 0.

    `node_ell` (N,) holds ℓ̄ at the boundary after each node (NaN where there is none: a
    final-answer turn). The root gets 0 (it is the prompt, not a turn).
    """
    parent = packed.node_parent
    has = torch.isfinite(node_ell)
    d = likelihood_gaps(torch.where(has, node_ell, torch.zeros_like(node_ell)), epsilon)  # (N,)
    dp = d[parent.clamp(min=0)]
    ok = has & (parent >= 0) & has[parent.clamp(min=0)]
    if bool((has & (parent >= 0) & ~has[parent.clamp(min=0)]).any()):
        raise ValueError("a node has a probe but its parent does not (every non-final turn ends a boundary)")
    return torch.where(ok, torch.log(dp / d), torch.zeros_like(d))


def node_turn_credit(
    packed: PackedTrees, node_ell: torch.Tensor, epsilon: float, gamma: float, horizon: int
) -> torch.Tensor:
    """(N,) R of every node: mean over the leaves below it of the per-path look-ahead R (0 at roots).

    For the path through node g at depth d ≥ 1 (turn k = d − 1):
        R_path(g) = Σ_{j=0}^{h−1} γ^j δ(node at depth d + j on that path).
    """
    delta = node_td_rewards(packed, node_ell.to(packed.node_parent.device, torch.float32), epsilon)  # (N,)
    nodes = path_nodes(packed)  # (L, D+1)
    valid = nodes >= 0
    dp = torch.where(valid, delta[nodes.clamp(min=0)], 0.0)  # (L, D+1); depth 0 (root) is 0
    R = lookahead_returns(dp, gamma, horizon)  # (L, D+1), padding contributes 0
    R[:, 0] = 0.0  # the root is the prompt, not a turn
    total = R.new_zeros(packed.num_nodes).index_add(0, nodes[valid], R[valid])
    return total / packed.node_leaf_count.clamp(min=1).to(R.dtype)
