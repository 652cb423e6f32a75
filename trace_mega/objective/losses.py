"""Policy losses on packed rollout trees, behind the `LOSSES` registry.

A loss reads one micro-batch as a `LossBatch`: its `PackedTrees` layout (docs/PACKING.md) and the
step's per-token advantages and loss weights sliced to it. Notation, per stream token t:
    x_t  = logπ_θ(y_t) − logπ_old(y_t),   r_t = exp(x_t)          (ratio)
    A_t  = batch.advantages[t],   w_t = batch.token_weight[t] (1 when None)
    m_t  = packed.loss_mask[t],   u_t = m_t · w_t                 (token's loss weight)
    n_t  = leaves below t's node (how many root-to-leaf paths contain t)
A "sequence" is a root-to-leaf path p (one trajectory); a shared-prefix token
belongs to n_t paths and gives each of them the share u_t / n_t, so that
|p| = Σ_{t∈p} u_t / n_t. With w_t = n_t (the `per_leaf` token weight of the
advantage estimators) every formula below equals the same loss on the
flattened paths (one row per trajectory, every token weight 1).

Aggregation modes (each names its unit; `LossConfig.aggregation`):
* ``token_mean``    — unit: tokens.    L = Σ_t u_t ℓ_t / Σ_t u_t.
* ``sequence_mean`` — unit: sequences. L = (1/P) Σ_p (1/|p|) Σ_{t∈p} (u_t/n_t) ℓ_t
  (P paths with |p| > 0).
* ``prompt_mean``   — unit: prompts.   L = (1/B) Σ_trees Σ_{t∈tree} u_t ℓ_t / Σ_{t∈tree} u_t
  (B trees with a loss token).
* ``seq_mean_token_sum_norm`` (Dr.GRPO) — unit: sequences.
  L = (1/P) Σ_p (1/C) Σ_{t∈p} (u_t/n_t) ℓ_t = Σ_t u_t ℓ_t / (C P), C = `seq_norm_tokens`
  (a constant, so a long sequence's tokens are not down-weighted as in sequence_mean).
All are L = Σ_t c_t ℓ_t with coefficients c from `aggregation_coefficients`.
For micro-batching / data parallelism pass `global_units` = the unit count of the
whole batch (`unit_count` summed over micro-batches and ranks, the micro-batches
holding whole trees): then the sum of the per-micro-batch losses is the loss of
the whole batch.

Losses (ℓ_t per token, then aggregated; ε_l / ε_h from `resolve_clip`):
* ``ppo_clip_token`` (GRPO): ℓ_t = −min(r_t A_t, clip(r_t, 1−ε_l, 1+ε_h) A_t),
  default aggregation token_mean (unit: tokens), ε_l = ε_h = 0.2.
* ``dapo``: the same token surrogate with clip-higher (default ε_l = 0.2, ε_h = 0.28),
  always token_mean over the whole batch (unit: tokens), DAPO's token-level loss.
* ``gspo``: sequence-level ratio s_p = exp((1/|p|) Σ_{t∈p} (u_t/n_t) x_t), GSPO-token form
  s_{p,t} = sg[s_p] · π_θ(y_t)/sg[π_θ(y_t)] so per-token advantages are allowed:
  L = −(1/P) Σ_p (1/|p|) Σ_{t∈p} (u_t/n_t) min(s_{p,t} A_t, clip(s_{p,t}, 1−ε_l, 1+ε_h) A_t),
  aggregation sequence_mean (unit: sequences), default ε_l = 3e-4, ε_h = 4e-4. With one
  advantage per path this is exactly GSPO: −(1/P) Σ_p min(s_p A_p, clip(s_p) A_p).
Every loss adds, with the same coefficients c_t,
* KL to the reference (k3): kl_coef · Σ_t c_t min(exp(q_t) − q_t − 1, kl_clamp), q_t = logπ_ref − logπ_θ
  clamped to ±20;
* entropy bonus: −entropy_coef · Σ_t c_t H_t.

Numerical guards (every loss): x_t is clamped to ±`LOG_RATIO_CLAMP` (20, as verl) before exp, so
no ratio overflows; dual-clip (`dual_clip_c` = c, default 3): for A < 0 the clipped surrogate is
further bounded, ℓ = min(ℓ, −c A) (for gspo on the sequence ratio), so a token (sequence) whose
ratio ran away cannot dominate the batch. Rollout importance weights (`is_weights`, (T,) detached,
see `rollout_is_weights`: truncated IS times the extreme-ratio mask, 0 for a non-finite engine log-prob)
multiply each token's surrogate before aggregation.

Metrics (detached scalars): policy_loss, loss, clip_fraction (share of the aggregation weight
whose min picked the clipped branch; gspo: share of sequences outside the clip range),
dual_clip_fraction, ratio_mean, ratio_max, approx_kl (k3 of the ratio: mean of r − 1 − log r),
kl_ref / entropy when their coefficients are non-zero.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from trace_mega.config import LossConfig
from trace_mega.credit.turn_credit import path_nodes
from trace_mega.registry import Registry
from trace_mega.rollout.tree import PackedTrees

__all__ = [
    "LOSSES",
    "LossBatch",
    "LossOutput",
    "LossFn",
    "AGGREGATIONS",
    "aggregation_coefficients",
    "signal_scale",
    "unit_count",
    "resolve_clip",
    "aggregation_mode",
    "path_token_index",
    "compute_loss",
    "ppo_clip_token",
    "dapo",
    "gspo",
    "kl_k3",
    "rollout_is_weights",
    "REJECT_OPTIONS",
    "LOG_RATIO_CLAMP",
]

AGGREGATIONS = ("token_mean", "sequence_mean", "prompt_mean", "seq_mean_token_sum_norm")

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before exp (verl's): e^20 ≈ 4.9e8 is finite in fp32, and so is its gradient."""

_CLIP_DEFAULTS = {"ppo_clip_token": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


@dataclass
class LossBatch:
    """One micro-batch as a loss reads it: the layout and the step's per-token inputs sliced to it."""

    packed: PackedTrees
    """The micro-batch's trees (whole trees: every group-relative quantity is local to it)."""
    advantages: torch.Tensor
    """(T,) fp32 per-token advantage A_t, 0 off the loss mask."""
    token_weight: Optional[torch.Tensor] = None
    """(T,) fp32 per-token loss weight w_t (None: 1)."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    metrics: dict[str, torch.Tensor]
    """Detached scalars (module docstring); keys ending in ``_max`` are maxima, the rest means."""


LossFn = Callable[..., LossOutput]
LOSSES: Registry[LossFn] = Registry("loss")


def resolve_clip(cfg: LossConfig, name: Optional[str] = None) -> tuple[float, float]:
    """(ε_low, ε_high): the config's values, or the named loss's defaults where they are None."""
    lo, hi = _CLIP_DEFAULTS[name or cfg.name]
    return (
        lo if cfg.clip_eps_low is None else cfg.clip_eps_low,
        hi if cfg.clip_eps_high is None else cfg.clip_eps_high,
    )


def aggregation_mode(cfg: LossConfig) -> str:
    """The aggregation the configured loss uses: dapo token_mean, gspo sequence_mean, else
    `cfg.aggregation` (default token_mean); pair with `unit_count` for micro-batching."""
    if cfg.name == "dapo":
        return "token_mean"
    if cfg.name == "gspo":
        return "sequence_mean"
    return cfg.aggregation or "token_mean"


def _token_units(batch: LossBatch) -> torch.Tensor:
    """(T,) u_t = loss_mask · token_weight."""
    m = batch.packed.loss_mask.float()
    return m if batch.token_weight is None else m * batch.token_weight.float()


def path_token_index(packed: PackedTrees) -> torch.Tensor:
    """(P, S) stream index of every root-to-leaf path's tokens in order, −1 on padding.

    The same as `packed.flatten().packed_index`, vectorised: each path is the concatenation
    of its nodes' [node_start, node_end) ranges.
    """
    nodes = path_nodes(packed)  # (P, D+1), -1 beyond the leaf
    P, D1 = nodes.shape
    g = nodes.clamp(min=0)
    lens = torch.where(nodes >= 0, packed.node_end[g] - packed.node_start[g], 0).reshape(-1)  # (P*(D+1),)
    row_len = lens.view(P, D1).sum(1)  # (P,)
    dev = nodes.device
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens)  # (Σ,) segment of every path token
    pos = torch.arange(seg.numel(), device=dev)
    stream = packed.node_start[g.reshape(-1)][seg] + pos - (lens.cumsum(0) - lens)[seg]
    row = seg // D1
    col = pos - (row_len.cumsum(0) - row_len)[row]
    out = torch.full((P, int(row_len.max()) if P else 0), -1, dtype=torch.long, device=dev)
    out[row, col] = stream
    return out


def _path_layout(batch: LossBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index (P, S) stream index of each path's tokens, clamped; share (P, S) u_t/n_t (0 on padding);
    length (P,) |p|)."""
    packed = batch.packed
    index = path_token_index(packed)  # (P, S), -1 on padding
    valid = index >= 0
    safe = index.clamp(min=0)
    n = packed.node_leaf_count[packed.token_node].float()  # (T,)
    share = torch.where(valid, (_token_units(batch) / n)[safe], 0.0)  # (P, S)
    return safe, share, share.sum(1)


def unit_count(batch: LossBatch, mode: str) -> torch.Tensor:
    """Local count of the aggregation unit: Σ u_t (tokens), paths with |p|>0, trees with a loss token."""
    if mode == "token_mean":
        return _token_units(batch).sum()
    if mode in ("sequence_mean", "seq_mean_token_sum_norm"):
        return (_path_layout(batch)[2] > 0).sum().float()
    if mode == "prompt_mean":
        per_tree = _tree_sums(batch.packed, _token_units(batch))
        return (per_tree > 0).sum().float()
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def signal_scale(batch: LossBatch, mode: str) -> float:
    """U / U_s for aggregation `mode`: the batch's unit count over that of its trees with signal (a loss token with
    A_t != 0). With the advantages times this, the policy term is its mean over those trees alone, while the KL and
    entropy terms keep their mean over every tree: the aggregations normalise within a path or a tree but for one
    batch-wide count. 1 when no tree has signal (the policy term is 0 then)."""
    signal = _tree_sums(batch.packed, batch.advantages.abs()) > 0  # (B,)
    tree_of_token = batch.packed.node_tree[batch.packed.token_node]
    weight = _token_units(batch) * signal[tree_of_token].to(torch.float32)
    kept = float(unit_count(replace(batch, token_weight=weight), mode))
    return float(unit_count(batch, mode)) / kept if kept > 0 else 1.0


def _tree_sums(packed: PackedTrees, values: torch.Tensor) -> torch.Tensor:
    """(num_trees,) Σ of per-token `values` over each tree."""
    tree_of_token = packed.node_tree[packed.token_node]  # (T,)
    return values.new_zeros(packed.num_trees).index_add(0, tree_of_token, values)


def aggregation_coefficients(
    batch: LossBatch,
    mode: str,
    global_units: Optional[float | torch.Tensor] = None,
    seq_norm_tokens: Optional[int] = None,
) -> torch.Tensor:
    """(T,) coefficients c with L = Σ_t c_t ℓ_t for aggregation `mode` (module docstring)."""
    packed, u = batch.packed, _token_units(batch)  # (T,)
    if mode == "seq_mean_token_sum_norm":
        if seq_norm_tokens is None:
            raise ValueError("seq_mean_token_sum_norm needs the constant seq_norm_tokens (loss.seq_norm_tokens)")
        P = (_path_layout(batch)[2] > 0).sum() if global_units is None else global_units
        # A token on n_t paths gives each u_t/n_t: Σ_{p∋t} (u_t/n_t) / (C P) = u_t / (C P).
        return u / (float(seq_norm_tokens) * torch.as_tensor(P, dtype=u.dtype).clamp(min=1))
    if mode == "token_mean":
        denom = u.sum() if global_units is None else global_units
        return u / torch.as_tensor(denom, dtype=u.dtype).clamp(min=1e-12)
    if mode == "sequence_mean":
        index, share, length = _path_layout(batch)
        P = (length > 0).sum() if global_units is None else global_units
        per = share / length.clamp(min=1e-12)[:, None]  # (P, S): share / |p|
        coef = u.new_zeros(u.shape).index_add(0, index.reshape(-1), per.reshape(-1))
        return coef / torch.as_tensor(P, dtype=u.dtype).clamp(min=1)
    if mode == "prompt_mean":
        per_tree = _tree_sums(packed, u)  # (B,)
        B = (per_tree > 0).sum() if global_units is None else global_units
        tree_of_token = packed.node_tree[packed.token_node]
        coef = u / per_tree.clamp(min=1e-12)[tree_of_token]
        return coef / torch.as_tensor(B, dtype=u.dtype).clamp(min=1)
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: Optional[float] = None) -> torch.Tensor:
    """(T,) k3 estimator of KL(π_θ || π_ref): exp(q) − q − 1, q = logπ_ref − logπ_θ clamped to ±20 (≥ 0),
    then clamped to at most `clamp` (None: not)."""
    q = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.exp(q) - q - 1.0
    return kl if clamp is None else kl.clamp(max=clamp)


def _mean_over_paths(values: torch.Tensor, index: torch.Tensor, packed: PackedTrees) -> torch.Tensor:
    """(T,) the mean of per-path `values` (P,) over the root-to-leaf paths through each token.

    `index` (P, S) is `path_token_index`; a token lies on the n_t paths below its node.
    """
    valid = index >= 0
    rows = valid.nonzero()[:, 0]
    n = packed.node_leaf_count[packed.token_node].to(values)  # (T,)
    return values.new_zeros(packed.num_tokens).index_add(0, index[valid], values[rows]) / n.clamp(min=1)


REJECT_OPTIONS = typing.get_args(typing.get_type_hints(LossConfig)["rollout_reject"])
"""verl's divergence rejection modes (`loss.rollout_reject`), k1's ratio bounds being `loss.rollout_mask`."""


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    batch: LossBatch,
    mode: str,
    cap: float,
    mask_mode: str = "none",
    mask_bounds: tuple[float, float] = (0.5, 2.0),
    reject: str = "none",
    reject_max: float = 0.01,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(T,) detached rollout-correction weights of the learner's π_old against the engine's π_beh.

    With d_t = logπ_old(y_t) − logπ_beh(y_t), r_t = exp(d_t), a path's log-ratio D_p = Σ_{t∈p} d_t and
    n_p its count of loss tokens:
    truncated IS (`mode`)      none: 1;  token: min(r_t, C);  sequence: min(exp(D_p), C)
    mask (`mask_mode`, [lo, hi])  none: 1;  token: 1[lo ≤ r_t ≤ hi];  sequence: 1[lo ≤ exp(D_p) ≤ hi];
                                  geometric: 1[lo ≤ exp(D_p / n_p) ≤ hi]
    rejection (`reject`, M)    verl's rollout_rs with k2_t = d_t²/2 or k3_t = r_t − 1 − d_t:
                                  token_k*: 1[k*_t ≤ M];  seq_{sum,mean,max}_k*: 1[sum / mean / max_{t∈p} k*_t ≤ M]
    w = IS · mask · rejection; factors of a path multiply per path and a token gets the mean of that
    product over the paths through it (the leaves below its node), the flattened trajectories' weight.
    Token IS with C = hi and a token mask is IcePop (verl's rollout_is_threshold "lo_hi"). A loss token
    whose engine log-prob is NaN or ±inf gets w = 0 and counts as masked; w = 1 off the loss mask. The
    token log-ratio is clamped to ±20 before exp and D_p to at most log C, so nothing overflows.
    Metrics (over loss tokens): mean and max of w, the fraction whose raw IS weight exceeded C,
    masked_fraction (1 − the mask and rejection factors, non-finite tokens included); with IS the sums
    whose ratio is the mean IS weight batch normalisation divides by (`is_norm_sum` / `is_norm_count`):
    token: Σ IS·mask over the finite loss tokens / their count; sequence: Σ IS·mask over the paths with
    one / their count, the mask's zeros counted (verl's IcePop) and the rejection's not (verl
    normalises before its rollout_rs).
    """
    packed = batch.packed
    mask = packed.loss_mask.to(old_logprobs.device)
    beh = behaviour_logprobs.to(old_logprobs)
    live = mask & torch.isfinite(beh) & torch.isfinite(old_logprobs)
    d = torch.where(live, (old_logprobs - beh).detach(), 0.0)  # (T,), finite
    log_cap, log_lo, log_hi = math.log(cap), math.log(mask_bounds[0]), math.log(mask_bounds[1])
    w = torch.ones_like(d)
    keep = live.to(d.dtype)  # (T,) the mask factor
    capped = torch.zeros_like(mask)
    if mode == "token":
        dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        capped = dc > log_cap
        w = torch.exp(dc.clamp(max=log_cap))
    elif mode not in ("none", "sequence"):
        raise ValueError(f"unknown rollout_is {mode!r}; valid: none, token, sequence")
    if mask_mode == "token":
        keep = keep * ((d >= log_lo) & (d <= log_hi)).to(d.dtype)
    elif mask_mode not in ("none", "sequence", "geometric"):
        raise ValueError(f"unknown rollout_mask {mask_mode!r}; valid: none, token, sequence, geometric")
    if reject not in REJECT_OPTIONS:
        raise ValueError(f"unknown rollout_reject {reject!r}; valid: {', '.join(REJECT_OPTIONS)}")
    level, k = reject.rsplit("_", 1) if reject != "none" else ("none", "")
    tok_mask = keep  # (T,) live · token mask, before the rejection
    if level != "none":  # fp64: k3 ≈ d²/2 of a bf16 engine's d ~ 1e-3 is below fp32's resolution of r
        dc = d.double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        div = 0.5 * dc.square() if k == "k2" else torch.expm1(dc) - dc  # (T,), 0 off the live tokens
        if level == "token":
            keep = keep * (div <= reject_max).to(d.dtype)
    by_path = mode == "sequence" or mask_mode in ("sequence", "geometric") or level.startswith("seq")
    if by_path:
        index = path_token_index(packed)  # (P, S), -1 on padding
        on = index >= 0

        def per_path(v: torch.Tensor) -> torch.Tensor:  # (T,) -> (P, S), 0 on padding
            return torch.where(on, v[index.clamp(min=0)], 0.0)

        log_w = per_path(d).sum(1)  # (P,) D_p
        path_w, path_keep = torch.ones_like(log_w), torch.ones_like(log_w)
        if mode == "sequence":
            path_w = torch.exp(log_w.clamp(max=log_cap))
            capped = _mean_over_paths((log_w > log_cap).to(d.dtype), index, packed) > 0.5
        if mask_mode != "none" and mask_mode != "token":
            # sequence: the path's product of ratios; geometric: its per-token geometric mean
            stat = log_w if mask_mode == "sequence" else log_w / per_path(live.to(d.dtype)).sum(1).clamp(min=1)
            path_keep = ((stat >= log_lo) & (stat <= log_hi)).to(d.dtype)
        path_mask = path_keep  # (P,) before the rejection
        if level.startswith("seq"):
            pd = per_path(div)  # (P, S) fp64
            n = per_path(live.double()).sum(1).clamp(min=1)
            stat = {"seq_sum": pd.sum(1), "seq_mean": pd.sum(1) / n, "seq_max": pd.amax(1)}[level]
            path_keep = path_keep * (stat <= reject_max).to(d.dtype)
        keep = keep * _mean_over_paths(path_keep, index, packed)
        if mode == "sequence":
            path_live = per_path(live.to(d.dtype)).sum(1) > 0
            norm = ((path_w * path_mask)[path_live].sum(), path_live.sum())
        elif mode == "token":
            norm = ((w * tok_mask * _mean_over_paths(path_mask, index, packed)).sum(), live.sum())
        # w·keep per path first, then the mean: a shared token's weight is its flattened paths' mean.
        w = w * _mean_over_paths(path_w * path_keep, index, packed)
        w = torch.where(keep > 0, w, 0.0)  # a non-finite or token-masked token stays 0
    else:
        norm = ((w * tok_mask).sum(), live.sum())
        w = w * keep
    w = torch.where(mask, w, torch.ones_like(w))
    mf = mask.to(w.dtype)
    cnt = mf.sum().clamp(min=1)
    metrics = {
        "rollout_is_mean": (w * mf).sum() / cnt,
        "rollout_is_max": (w * mf).max() if w.numel() else w.sum(),
        "rollout_is_capped_fraction": (capped.to(w.dtype) * mf).sum() / cnt,
        "masked_fraction": ((1.0 - keep) * mf).sum() / cnt,
    }
    if mode != "none":  # verl's rollout_is_batch_normalize divides w by the batch's norm_sum / norm_count
        metrics["is_norm_sum"], metrics["is_norm_count"] = norm[0].float(), norm[1].float()
    return w.detach(), metrics


def _inputs(logprobs, batch: LossBatch, old_logprobs):
    packed = batch.packed
    if logprobs.shape != packed.tokens.shape:
        raise ValueError(f"logprobs must be (T={packed.num_tokens},), got {tuple(logprobs.shape)}")
    mask = packed.loss_mask.to(logprobs.device)
    old = packed.behaviour_logprobs if old_logprobs is None else old_logprobs
    # Non-loss tokens get x = 0 (ratio 1) so nothing there can overflow into a 0-weighted inf;
    # the clamp bounds every ratio (its gradient is 0 beyond ±20: such a token is off-policy noise).
    # A non-finite old log-prob (an engine's NaN / -inf with old_logprobs: behaviour) gets x = 0 too;
    # the rollout-correction weights give that token 0.
    old = old.to(logprobs)
    x = torch.where(mask & torch.isfinite(old), logprobs - old, torch.zeros_like(logprobs))
    return mask, x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), batch.advantages.to(logprobs)


def _ratio_metrics(coef: torch.Tensor, mask: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """ratio_mean (coefficient-weighted), ratio_max (over loss tokens), approx_kl = weighted mean of r − 1 − x."""
    x = x.detach()
    r = torch.exp(x)
    w = coef.detach() / coef.detach().sum().clamp(min=1e-12)
    r_max = torch.where(mask, r, torch.zeros_like(r)).max() if r.numel() else r.sum()
    return {"ratio_mean": (w * r).sum(), "ratio_max": r_max, "approx_kl": (w * (r - 1.0 - x)).sum()}


def _dual_clip(loss_terms: torch.Tensor, adv: torch.Tensor, c: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ with ℓ ≤ −c·A where A < 0, bool where the bound acted); no-op for c None."""
    if c is None:
        return loss_terms, torch.zeros_like(loss_terms, dtype=torch.bool)
    bound = -c * adv
    hit = (adv < 0) & (loss_terms > bound)
    return torch.where(hit, bound, loss_terms), hit


def _finish(policy, coef, mask, logprobs, cfg, ref_logprobs, entropy, metrics) -> LossOutput:
    loss = policy
    metrics["policy_loss"] = policy.detach()
    if cfg.kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("loss.kl_coef != 0 needs ref_logprobs")
        kl = (coef * torch.where(mask, kl_k3(logprobs, ref_logprobs.to(logprobs), cfg.kl_clamp), 0.0)).sum()
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    if cfg.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("loss.entropy_coef != 0 needs entropy")
        ent = (coef * torch.where(mask, entropy, 0.0)).sum()
        loss = loss - cfg.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    metrics["loss"] = loss.detach()
    return LossOutput(loss, metrics)


def _clipped_token_loss(
    logprobs, batch, cfg, mode, eps, old_logprobs, ref_logprobs, entropy, global_units, is_weights
) -> LossOutput:
    mask, x, adv = _inputs(logprobs, batch, old_logprobs)
    coef = aggregation_coefficients(batch, mode, global_units, cfg.seq_norm_tokens).to(logprobs)  # (T,)
    ratio = torch.exp(x)  # (T,)
    clipped = ratio.clamp(1.0 - eps[0], 1.0 + eps[1])
    surr = -torch.minimum(ratio * adv, clipped * adv)  # (T,)
    surr, dual = _dual_clip(surr, adv, cfg.dual_clip_c)
    if is_weights is not None:
        surr = surr * is_weights.to(surr)
    policy = (coef * surr).sum()
    was_clipped = (clipped * adv < ratio * adv).float()  # the min picked the clipped branch
    total = coef.sum().clamp(min=1e-12).detach()
    metrics = {
        "clip_fraction": (coef * was_clipped).sum().detach() / total,
        "dual_clip_fraction": (coef * dual.float()).sum().detach() / total,
        **_ratio_metrics(coef, mask, x),
    }
    return _finish(policy, coef, mask, logprobs, cfg, ref_logprobs, entropy, metrics)


@LOSSES.register("ppo_clip_token")
def ppo_clip_token(
    logprobs,
    batch: LossBatch,
    cfg: LossConfig,
    *,
    old_logprobs=None,
    ref_logprobs=None,
    entropy=None,
    global_units=None,
    is_weights=None,
) -> LossOutput:
    """GRPO's token-level PPO-clip; aggregation `cfg.aggregation`, default token_mean (unit: tokens)."""
    return _clipped_token_loss(
        logprobs,
        batch,
        cfg,
        cfg.aggregation or "token_mean",
        resolve_clip(cfg, "ppo_clip_token"),
        old_logprobs,
        ref_logprobs,
        entropy,
        global_units,
        is_weights,
    )


@LOSSES.register("dapo")
def dapo(
    logprobs,
    batch: LossBatch,
    cfg: LossConfig,
    *,
    old_logprobs=None,
    ref_logprobs=None,
    entropy=None,
    global_units=None,
    is_weights=None,
) -> LossOutput:
    """DAPO: clip-higher token PPO-clip, token_mean over the whole batch (unit: tokens)."""
    if cfg.aggregation not in (None, "token_mean"):
        raise ValueError(f"dapo aggregates by token_mean (its token-level loss), not {cfg.aggregation!r}")
    return _clipped_token_loss(
        logprobs,
        batch,
        cfg,
        "token_mean",
        resolve_clip(cfg, "dapo"),
        old_logprobs,
        ref_logprobs,
        entropy,
        global_units,
        is_weights,
    )


@LOSSES.register("gspo")
def gspo(
    logprobs,
    batch: LossBatch,
    cfg: LossConfig,
    *,
    old_logprobs=None,
    ref_logprobs=None,
    entropy=None,
    global_units=None,
    is_weights=None,
) -> LossOutput:
    """GSPO (GSPO-token form): sequence-level ratio per root-to-leaf path, sequence_mean (unit: sequences)."""
    if cfg.aggregation not in (None, "sequence_mean"):
        raise ValueError(f"gspo aggregates by sequence_mean (unit: sequences), not {cfg.aggregation!r}")
    eps_lo, eps_hi = resolve_clip(cfg, "gspo")
    mask, x, adv = _inputs(logprobs, batch, old_logprobs)
    index, share, length = _path_layout(batch)  # (P, S), (P, S), (P,)
    share, length = share.to(logprobs), length.to(logprobs)
    live = length > 0
    P = live.sum() if global_units is None else global_units
    P = torch.as_tensor(P, dtype=logprobs.dtype).clamp(min=1)
    xp = x[index]  # (P, S): gather, so a shared token's gradient sums over its paths
    log_s = (share * xp).sum(1) / length.clamp(min=1e-12)  # (P,), within ±20 (a mean of clamped x)
    s = torch.exp(log_s).detach()  # (P,) the sequence ratio's value
    s_pt = s[:, None] * torch.exp(xp - xp.detach())  # (P, S): value s_p, gradient of π_θ(y_t)
    ap = adv[index]  # (P, S)
    clipped = s_pt.clamp(1.0 - eps_lo, 1.0 + eps_hi)
    term = -torch.minimum(s_pt * ap, clipped * ap)  # (P, S) per-token loss
    term, dual = _dual_clip(term, ap, cfg.dual_clip_c)  # on the sequence ratio's value
    if is_weights is not None:
        term = term * is_weights.to(term)[index]
    per = share / length.clamp(min=1e-12)[:, None]  # (P, S): (u_t/n_t)/|p|
    policy = (per * term).sum() / P
    coef = aggregation_coefficients(batch, "sequence_mean", global_units).to(logprobs)
    lw = live.to(s.dtype) / live.sum().clamp(min=1)  # (P,) mean over the paths with loss tokens
    metrics = {
        "clip_fraction": (lw * ((s < 1.0 - eps_lo) | (s > 1.0 + eps_hi)).to(s.dtype)).sum(),
        "dual_clip_fraction": (per * dual.to(per.dtype)).sum().detach() / live.sum().clamp(min=1),
        "ratio_mean": (lw * s).sum(),
        "ratio_max": torch.where(live, s, torch.zeros_like(s)).max() if s.numel() else s.sum(),
        "approx_kl": _ratio_metrics(coef, mask, x)["approx_kl"],
    }
    return _finish(policy, coef, mask, logprobs, cfg, ref_logprobs, entropy, metrics)


def compute_loss(logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig, **kw) -> LossOutput:
    """The loss named by `cfg.name` (see `LOSSES.names()`) of (T,) `logprobs` on `batch`."""
    return LOSSES.check(cfg.name, "loss.name")(logprobs, batch, cfg, **kw)
