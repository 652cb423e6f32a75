"""Advantage estimators on rollout trees, behind the `ADVANTAGES` registry.

Every estimator maps a `PackedTrees` (and the `RolloutTree`s it was packed from, same
order) to one advantage per node, A(n), and then per stream token:

    advantages[t]   = A(node of t) · m_t                      (m_t = loss mask)
    token_weight[t] = m_t · (1 if shared_token_weight == "once" else n(node of t))
                      (· 0 on a tree whose A(n) are all 0, with `drop_uncontrasted`; with
                      `drop_uncontrasted_from: policy_gradient` the weights stay and the learner
                      scales the advantages instead, `losses.signal_scale`)

n(g) = leaves below node g; roots (prompts) get A = 0. Each token of a shared prefix is stored once in the packed
stream; "once" counts it once in the loss (the default: a shared turn is one decision),
"per_leaf" counts it once per trajectory through it, which makes the packed loss's
linear term equal to training on the flattened paths (losses.py states the
aggregation formulas).

Notation: r_l reward of leaf l; V(g) = (1/n(g)) Σ_{l below g} r_l (mean reward below g);
a group-relative deviation of x_i within a group G is
    dev_G(x_i) = x_i − mean_G(x)                 or, with `normalize_std`,
    dev_G(x_i) = (x_i − mean_G(x)) / (std_G(x) + 1e-6)   (std with Bessel's correction)
and is 0 for a group of one (no contrast).

* ``grpo`` — the root group: every leaf of a tree, A_l = dev_tree(r_l). A shared node
  gets the mean over the leaves below it: A(g) = (1/n(g)) Σ_{l below g} A_l.
* ``rloo`` — REINFORCE leave-one-out (Ahmadian et al. 2024) on the root group: every leaf's
  baseline is the mean reward of the *other* leaves of its tree,
      A_l = r_l − (1/(G−1)) Σ_{j≠l} r_j = G/(G−1) · (r_l − mean_tree(r)),
  0 for a group of one, never divided by a std; a shared node gets the mean over its leaves.
* ``tree`` — group-relative at every branch point, summed along the path. At a node b
  with children c_1 … c_m (m ≥ 2) the group is b's children and each child c gets
  e(c) = dev_{children(b)}(V(c)) (each child is one sampled continuation of H_b, so the
  baseline is the unweighted mean of the children's values); an edge below a node with
  one child gets e = 0. Then
      A(n) = Σ_{edges (b → c) on the path root → n} e(c).
  On a flat tree (the root's children are the leaves) A(leaf) = dev_root(r) = grpo, and
  A at an internal node n accumulates every branch-point contrast above it.
* ``gigpo`` — GiGPO-style two-level grouping (Feng et al. 2025): episode term
  A_E(n) = grpo's A(n), plus ω · A_S(n) with anchor-state groups: turn node n acts from
  the state left by its parent; nodes of one tree whose parents left the same state
  (the same observation text; the prompt for the first turn; a parent with an empty
  observation is its own state) form a group, and
      G(n)   = (1/n(n)) Σ_{l below n} γ^{depth(l) − depth(n)} r_l     (discounted return)
      A_S(n) = dev_anchor(n)(G(n)),    A(n) = A_E(n) + ω A_S(n).
* ``trace_credit`` — TRACE-C (docs/design.md §4, trace_mega/credit/turn_credit.py): A(n) = mix(β R(n), A^out(n)) with
  A^out from the estimator `AdvantageConfig.name` (grpo | rloo | tree | gigpo) and R(n) the
  reference-probe turn credit; the mix is `resolve_mixing` (A^out(n) + β R(n) on every turn
  under ``tree``, so a flat probe, R = 0, gives exactly the credit-off advantages); chosen by `CreditConfig.enabled`, so ``tree`` +
  ``trace_credit`` (TRACE-A + TRACE-C) is `advantage.name: tree, credit.enabled: true`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from trace_mega.config import AdvantageConfig, CreditConfig
from trace_mega.credit.turn_credit import mix_turn_advantages, node_turn_credit
from trace_mega.objective.losses import LossBatch
from trace_mega.registry import Registry
from trace_mega.rollout.tree import PackedTrees, RolloutTree

__all__ = [
    "ADVANTAGES",
    "Advantages",
    "AdvantageFn",
    "compute_advantages",
    "leaf_mean",
    "group_relative",
    "grpo",
    "rloo",
    "tree",
    "gigpo",
    "trace_credit",
    "resolve_mixing",
    "STD_EPS",
]

STD_EPS = 1e-6


@dataclass
class Advantages:
    advantages: torch.Tensor
    """(T,) fp32 per-token advantage, 0 off the loss mask."""
    token_weight: torch.Tensor
    """(T,) fp32 per-token loss weight, 0 off the loss mask."""
    node_advantage: torch.Tensor
    """(N,) fp32 A(n) per node."""
    pg_over_signal: bool = False
    """The policy gradient's mean runs over the trees with signal, the other terms' over every tree: the learner
    scales each mini-batch's advantages by `losses.signal_scale` (`drop_uncontrasted_from: policy_gradient`)."""

    def loss_batch(self, packed: PackedTrees, tokens: Optional[torch.Tensor] = None) -> LossBatch:
        """The loss's input for `packed`: the whole layout these advantages were computed on, or (with
        `tokens`, (T_mb,) stream indices into it) a micro-batch of its trees, `packed.select(...)`."""
        if tokens is None:
            return LossBatch(packed, self.advantages, self.token_weight)
        return LossBatch(packed, self.advantages[tokens], self.token_weight[tokens])


AdvantageFn = Callable[..., Advantages]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def group_relative(values: torch.Tensor, group: torch.Tensor, num_groups: int, normalize_std: bool) -> torch.Tensor:
    """(M,) dev_G(values) within integer groups `group` (M,) (module docstring)."""
    ones = torch.ones_like(values)
    count = values.new_zeros(num_groups).index_add(0, group, ones)  # (G,)
    mean = values.new_zeros(num_groups).index_add(0, group, values) / count.clamp(min=1)
    dev = values - mean[group]
    if normalize_std:
        var = values.new_zeros(num_groups).index_add(0, group, dev * dev) / (count - 1).clamp(min=1)
        dev = dev / (var.sqrt()[group] + STD_EPS)
    return torch.where(count[group] >= 2, dev, torch.zeros_like(dev))


def leaf_mean(packed: PackedTrees, leaf_values: torch.Tensor) -> torch.Tensor:
    """(N,) mean of per-leaf values (L,) over the leaves below each node (0 where none).

    Leaves below g are the pre-order ids g … node_exit[g]; `leaf_nodes` is sorted, so this
    is a difference of prefix sums.
    """
    ids = torch.arange(packed.num_nodes, device=packed.node_exit.device)
    lo = torch.searchsorted(packed.leaf_nodes, ids, right=False)
    hi = torch.searchsorted(packed.leaf_nodes, packed.node_exit, right=True)
    csum = torch.cat([leaf_values.new_zeros(1), leaf_values.cumsum(0)])  # (L+1,)
    count = (hi - lo).to(leaf_values.dtype)
    out = (csum[hi] - csum[lo]) / count.clamp(min=1)
    out[packed.leaf_nodes] = leaf_values  # exact at the leaves (no prefix-sum rounding)
    return out


def _path_sum(packed: PackedTrees, edge: torch.Tensor) -> torch.Tensor:
    """(N,) Σ of `edge` (N,) over the nodes from the root down to each node (edge of a root counts)."""
    out = edge.clone()
    depth = packed.node_depth
    for d in range(1, int(depth.max()) + 1 if packed.num_nodes else 0):  # parents are finished first
        idx = torch.nonzero(depth == d).squeeze(1)
        out[idx] = out[packed.node_parent[idx]] + edge[idx]
    return out


def _node_values(packed: PackedTrees) -> torch.Tensor:
    """(N,) V(g): mean reward of the leaves below g."""
    return packed.node_reward_sum.float() / packed.node_leaf_count.clamp(min=1).float()


def _to_tokens(packed: PackedTrees, node_adv: torch.Tensor, cfg: AdvantageConfig) -> Advantages:
    node_adv = torch.where(packed.node_parent >= 0, node_adv, 0.0)  # a root is the prompt, not a decision
    m = packed.loss_mask.float()  # (T,)
    adv = node_adv[packed.token_node] * m
    if cfg.shared_token_weight == "once":
        weight = m
    elif cfg.shared_token_weight == "per_leaf":
        weight = packed.node_leaf_count[packed.token_node].float() * m
    else:
        raise ValueError(f"unknown shared_token_weight {cfg.shared_token_weight!r}; valid: once, per_leaf")
    if cfg.drop_uncontrasted and cfg.drop_uncontrasted_from == "loss":  # it leaves the mean, as a filtered group
        signal = node_adv.new_zeros(packed.num_trees).index_add(0, packed.node_tree, node_adv.abs()) > 0  # (B,)
        weight = weight * signal[packed.node_tree[packed.token_node]].to(weight)
    return Advantages(adv, weight, node_adv, pg_over_signal=cfg.drop_uncontrasted_from == "policy_gradient")


def _grpo_nodes(packed: PackedTrees, normalize_std: bool) -> torch.Tensor:
    leaf_adv = group_relative(
        packed.leaf_reward.float(), packed.node_tree[packed.leaf_nodes], packed.num_trees, normalize_std
    )  # (L,)
    return leaf_mean(packed, leaf_adv)


@ADVANTAGES.register("grpo")
def grpo(packed: PackedTrees, trees: Sequence[RolloutTree], cfg: AdvantageConfig, **_) -> Advantages:
    """Root group per tree; shared nodes get the mean of the leaf advantages below them."""
    return _to_tokens(packed, _grpo_nodes(packed, cfg.normalize_std), cfg)


@ADVANTAGES.register("rloo")
def rloo(packed: PackedTrees, trees: Sequence[RolloutTree], cfg: AdvantageConfig, **_) -> Advantages:
    """Leave-one-out baseline within each tree's leaves; shared nodes get the mean of the leaves below."""
    if cfg.normalize_std:
        raise ValueError("rloo's leave-one-out baseline is not std-normalised; set advantage.normalize_std: false")
    r = packed.leaf_reward.float()
    group = packed.node_tree[packed.leaf_nodes]
    dev = group_relative(r, group, packed.num_trees, normalize_std=False)  # r_l − mean, 0 for a lone leaf
    G = r.new_zeros(packed.num_trees).index_add(0, group, torch.ones_like(r))[group]  # (L,) group sizes
    return _to_tokens(packed, leaf_mean(packed, dev * G / (G - 1).clamp(min=1)), cfg)


@ADVANTAGES.register("tree")
def tree(packed: PackedTrees, trees: Sequence[RolloutTree], cfg: AdvantageConfig, **_) -> Advantages:
    """Σ over the branch points on the path of the child's group-relative value (module docstring)."""
    V = _node_values(packed)  # (N,)
    parent = packed.node_parent
    child = torch.nonzero(parent >= 0).squeeze(1)  # (N - roots,)
    edge = torch.zeros_like(V)
    edge[child] = group_relative(V[child], parent[child], packed.num_nodes, cfg.normalize_std)
    return _to_tokens(packed, _path_sum(packed, edge), cfg)


def _anchor_groups(packed: PackedTrees, trees: Sequence[RolloutTree]) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn node ids (M,), anchor group id (M,)) for gigpo: the state each turn acts from."""
    keys: dict[tuple, int] = {}
    nodes, groups = [], []
    for g in range(packed.num_nodes):
        p = int(packed.node_parent[g])
        if p < 0:
            continue
        ti, plid = packed.node_local[p]
        obs = trees[ti].nodes[plid].observation
        key = (ti, "prompt") if plid == 0 else (ti, "obs", obs) if obs else (ti, "node", plid)
        nodes.append(g)
        groups.append(keys.setdefault(key, len(keys)))
    dev = packed.node_parent.device
    return torch.tensor(nodes, dtype=torch.long, device=dev), torch.tensor(groups, dtype=torch.long, device=dev)


@ADVANTAGES.register("gigpo")
def gigpo(packed: PackedTrees, trees: Sequence[RolloutTree], cfg: AdvantageConfig, **_) -> Advantages:
    """Episode (grpo) advantage + ω · anchor-state step advantage of discounted returns."""
    if len(trees) != packed.num_trees:
        raise ValueError(f"gigpo needs the {packed.num_trees} packed trees, got {len(trees)}")
    episode = _grpo_nodes(packed, cfg.normalize_std)  # (N,)
    depth = packed.node_depth.float()
    g = cfg.gigpo_gamma
    # G(n) = γ^{-depth n} · mean_l γ^{depth l} r_l over the leaves below n.
    leaf_disc = packed.leaf_reward.float() * g ** depth[packed.leaf_nodes]
    ret = leaf_mean(packed, leaf_disc) * g ** (-depth)  # (N,)
    nodes, groups = _anchor_groups(packed, trees)
    step = torch.zeros_like(episode)
    if nodes.numel():
        step[nodes] = group_relative(ret[nodes], groups, int(groups.max()) + 1, cfg.normalize_std)
    return _to_tokens(packed, episode + cfg.gigpo_step_weight * step, cfg)


def resolve_mixing(credit: CreditConfig, cfg: AdvantageConfig) -> str:
    """The credit mixing in force: `credit.mixing`, with "auto" = broadcast under the `tree` outcome
    term (anchored would zero the branch-point contrasts of every internal turn: docs/credit.md)
    and anchored (the paper's rule) under the others."""
    if credit.mixing != "auto":
        return credit.mixing
    return "broadcast" if cfg.name == "tree" else "anchored"


@ADVANTAGES.register("trace_credit")
def trace_credit(
    packed: PackedTrees,
    trees: Sequence[RolloutTree],
    cfg: AdvantageConfig,
    *,
    credit: Optional[CreditConfig] = None,
    node_ell: Optional[torch.Tensor] = None,
    **_,
) -> Advantages:
    """TRACE-C: outcome estimator `cfg.name` mixed with the probe turn credit (trace_mega/credit/turn_credit.py)."""
    if credit is None or node_ell is None:
        raise ValueError("trace_credit needs the CreditConfig and the probe's node_ell (N,)")
    if cfg.name == "trace_credit":
        raise ValueError(
            "advantage.name picks the outcome term of trace_credit (grpo | tree | gigpo); "
            "TRACE-C itself is switched on by credit.enabled"
        )
    if node_ell.shape != (packed.num_nodes,):
        raise ValueError(f"node_ell must be (N={packed.num_nodes},), got {tuple(node_ell.shape)}")
    outcome = ADVANTAGES.check(cfg.name, "advantage.name")(packed, trees, cfg)
    R = node_turn_credit(packed, node_ell, credit.epsilon, credit.gamma_td, credit.lookahead_turns)
    ids = torch.arange(packed.num_nodes, device=packed.node_exit.device)
    is_final = (packed.node_exit == ids) & (packed.node_parent >= 0)  # (N,) leaves: last turns
    node_adv = mix_turn_advantages(R, outcome.node_advantage, is_final, resolve_mixing(credit, cfg), credit.beta)
    return _to_tokens(packed, node_adv, cfg)


def compute_advantages(
    packed: PackedTrees,
    trees: Sequence[RolloutTree],
    cfg: AdvantageConfig,
    credit: Optional[CreditConfig] = None,
    node_ell: Optional[torch.Tensor] = None,
) -> Advantages:
    """The configured estimator (trace_credit over `cfg.name` when `credit.enabled`); `packed` is not modified."""
    if credit is not None and credit.enabled:
        return trace_credit(packed, trees, cfg, credit=credit, node_ell=node_ell)
    return ADVANTAGES.check(cfg.name, "advantage.name")(packed, trees, cfg)
