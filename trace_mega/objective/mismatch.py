"""Training–inference mismatch: the engine's sampling log-probs against the learner's, measured and corrected.

Per loss token t of a micro-batch, lp_l = the learner's log-prob before the update (its old
log-probs; the current ones, detached, with `loss.old_logprobs: behaviour`), lp_e = the engine's
sampling log-prob, x_t = lp_l − lp_e and r_t = exp(x_t) (π_learner / π_engine). Tokens whose lp_e
(or lp_l) is NaN or ±inf are left out of every metric below and counted (`mismatch/nonfinite_frac`);
the rollout correction gives them weight 0 (`losses.rollout_is_weights`). Token metrics average over
the remaining loss tokens, each stream token once (a shared prefix is one token); path metrics
average over root-to-leaf paths p with such a token, each path over all of its tokens (the
flattened trajectory). The formulas are verl's `compute_offpolicy_metrics` and
`compute_is_metrics` (verl/trainer/ppo/rollout_corr_helper.py):

    mismatch/kl                  mean_t (lp_e − lp_l)                    KL(π_engine || π_learner), k1
    mismatch/k3                  mean_t (r_t − 1 − x_t)                  the same KL, k3 (verl's k3_kl)
    mismatch/chi2_token          mean_t r_t² − 1
    mismatch/ratio_outside_frac  share of t with r_t ∉ [0.5, 2]          (fixed bounds, the metric's own)
    mismatch/logprob_abs_max     max_t |x_t|
    mismatch/training_ppl        mean_p exp(−m_l(p)),  m_l(p) = mean_{t∈p} lp_l
    mismatch/rollout_ppl         mean_p exp(−m_e(p)),  m_e(p) = mean_{t∈p} lp_e
    mismatch/log_ppl_diff        mean_p (m_e(p) − m_l(p))                log(training_ppl_p / rollout_ppl_p)
    mismatch/log_ppl_abs_diff    mean_p |m_e(p) − m_l(p)|
    mismatch/ppl_ratio           mean_p exp(m_e(p) − m_l(p))
    mismatch/chi2_seq            mean_p exp(2 Σ_{t∈p} x_t) − 1
    mismatch/nonfinite_frac      share of loss tokens with a non-finite log-prob
    mismatch/masked_frac         share of loss tokens the rollout mask (or non-finiteness) zeroes
    loss/logprob_mismatch        mean_t |x_t|

x_t is clamped to ±20 (verl's SAFETY_BOUND) inside exp for k3 and chi2_token, and Σ x_t for chi2_seq,
so no metric overflows (verl clamps the chi2 terms only). Each micro-batch returns additive sums
(``mismatch_*_sum``, one ``_max``): the learner sums them over micro-batches, data-parallel ranks and
optimiser steps like every loss metric, and `mismatch_metrics` divides once, so the step's values are
those of the whole batch (micro-batches hold whole trees, so a path is never split).
"""

from __future__ import annotations

import math

import torch

from trace_mega.config import LossConfig
from trace_mega.objective.losses import LOG_RATIO_CLAMP, LossBatch, path_token_index, rollout_is_weights
from trace_mega.rollout.tree import PackedTrees

__all__ = ["MISMATCH_RATIO_BOUNDS", "mismatch_sums", "mismatch_metrics", "correction_weights", "rollout_correction"]

MISMATCH_RATIO_BOUNDS = (0.5, 2.0)
"""Bounds of `mismatch/ratio_outside_frac` (fixed: a metric comparable across runs, not the mask's)."""

_PREFIX = "mismatch_"


def mismatch_sums(learner_lp: torch.Tensor, engine_lp: torch.Tensor, packed: PackedTrees) -> dict[str, torch.Tensor]:
    """The additive pieces of the mismatch metrics of one micro-batch (module docstring).

    `learner_lp`, `engine_lp`: (T,) log-probs of the layout's tokens (read on the loss mask only).
    """
    mask = packed.loss_mask.to(learner_lp.device)
    # fp64: r − 1 − x cancels (k3 ≈ x²/2 ~ 1e-7 for a bf16 engine's x ~ 1e-3, below fp32's resolution of r).
    lp_l = learner_lp.detach().double()
    lp_e = engine_lp.to(lp_l)
    ok = mask & torch.isfinite(lp_e) & torch.isfinite(lp_l)  # (T,)
    okf = ok.float()
    x = torch.where(ok, lp_l - lp_e, 0.0)  # (T,) log r, 0 where left out
    xc = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(xc)
    lo, hi = (math.log(b) for b in MISMATCH_RATIO_BOUNDS)
    out = {
        "mismatch_loss_tokens_sum": mask.sum().float(),
        "mismatch_tokens_sum": okf.sum(),
        "mismatch_nonfinite_sum": (mask & ~ok).sum().float(),
        "mismatch_abs_sum": x.abs().sum(),
        "mismatch_logprob_abs_max": x.abs().max() if x.numel() else x.sum(),
        "mismatch_kl_sum": -x.sum(),
        "mismatch_k3_sum": ((r - 1.0 - xc) * okf).sum(),
        "mismatch_chi2_token_sum": (torch.expm1(2.0 * xc) * okf).sum(),  # Σ (r² − 1), see below
        "mismatch_outside_sum": (((x < lo) | (x > hi)) & ok).sum().float(),
    }
    # Paths: (P, S) gathers of each root-to-leaf path's tokens (micro-batches hold whole trees).
    index = path_token_index(packed)
    on = (index >= 0) & ok[index.clamp(min=0)]
    safe = index.clamp(min=0)
    n = on.sum(1)  # (P,) tokens kept on each path
    live = n > 0
    m_l = torch.where(on, lp_l[safe], 0.0).sum(1) / n.clamp(min=1)  # (P,) mean log-prob per path
    m_e = torch.where(on, lp_e[safe], 0.0).sum(1) / n.clamp(min=1)
    diff = m_e - m_l  # (P,) log(training_ppl / rollout_ppl)
    seq_x = torch.where(on, x[safe], 0.0).sum(1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    def path_sum(v: torch.Tensor) -> torch.Tensor:
        return torch.where(live, v, 0.0).sum()  # where, not a product: v may be inf on a dead path

    # Sums of quantities near 1 (r², PPL ratios) are kept centred (minus 1): the learner's metric
    # reduction is fp32, where Σ r² over 1e5 tokens would round a 1e-9 chi2 to 0.
    out.update(
        mismatch_paths_sum=live.sum().float(),
        mismatch_training_ppl_sum=path_sum(torch.exp(-m_l)),
        mismatch_rollout_ppl_sum=path_sum(torch.exp(-m_e)),
        mismatch_log_ppl_diff_sum=path_sum(diff),
        mismatch_log_ppl_abs_diff_sum=path_sum(diff.abs()),
        mismatch_ppl_ratio_sum=path_sum(torch.expm1(diff)),
        mismatch_chi2_seq_sum=path_sum(torch.expm1(2.0 * seq_x)),
    )
    return out


def mismatch_metrics(total: dict[str, float]) -> dict[str, float]:
    """Pops the ``mismatch_*`` sums from `total` (already summed over micro-batches, ranks and
    optimiser steps) and returns the step's ``mismatch/*`` metrics and ``loss/logprob_mismatch``."""
    s = {k.removeprefix(_PREFIX): total.pop(k) for k in [k for k in total if k.startswith(_PREFIX)]}
    t, p = max(s["tokens_sum"], 1.0), max(s["paths_sum"], 1.0)
    loss_tokens = max(s["loss_tokens_sum"], 1.0)
    return {
        "loss/logprob_mismatch": s["abs_sum"] / t,
        "mismatch/kl": s["kl_sum"] / t,
        "mismatch/k3": s["k3_sum"] / t,
        "mismatch/chi2_token": s["chi2_token_sum"] / t,
        "mismatch/ratio_outside_frac": s["outside_sum"] / t,
        "mismatch/logprob_abs_max": s["logprob_abs_max"],
        "mismatch/training_ppl": s["training_ppl_sum"] / p,
        "mismatch/rollout_ppl": s["rollout_ppl_sum"] / p,
        "mismatch/log_ppl_diff": s["log_ppl_diff_sum"] / p,
        "mismatch/log_ppl_abs_diff": s["log_ppl_abs_diff_sum"] / p,
        "mismatch/ppl_ratio": 1.0 + s["ppl_ratio_sum"] / p,
        "mismatch/chi2_seq": s["chi2_seq_sum"] / p,
        "mismatch/nonfinite_frac": s["nonfinite_sum"] / loss_tokens,
        "mismatch/masked_frac": s["masked_sum"] / loss_tokens,
    }


def correction_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`losses.rollout_is_weights` under the corrections `cfg` (loss.rollout_is / _mask / _reject) sets."""
    bounds = (cfg.rollout_mask_low, cfg.rollout_mask_high)
    return rollout_is_weights(
        old_logprobs, engine_logprobs, batch, cfg.rollout_is, cfg.rollout_is_cap, cfg.rollout_mask, bounds,
        cfg.rollout_reject, cfg.rollout_reject_max,
    )  # fmt: skip


def rollout_correction(
    old_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    learner_logprobs: torch.Tensor,
    batch: LossBatch,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(T,) detached weights of the policy surrogate and the micro-batch's metric sums.

    The weights are `correction_weights` (all 1 but for
    non-finite engine log-probs, which get 0, when all are none: multiplying by 1 is exact). The
    sums: `mismatch_sums` of `learner_logprobs` against `engine_logprobs`, the masked-token count,
    and with `cfg.rollout_is` the IS weights' token sums (``rollout_is_*_tok_sum``) and maximum.
    """
    mask = batch.packed.loss_mask.to(old_logprobs.device)
    w, m = correction_weights(old_logprobs, engine_logprobs, batch, cfg)
    tokens = mask.sum().float()
    sums = mismatch_sums(learner_logprobs, engine_logprobs, batch.packed)
    sums["mismatch_masked_sum"] = m["masked_fraction"] * tokens
    if cfg.rollout_is != "none":
        sums["rollout_is_mean_tok_sum"] = m["rollout_is_mean"] * tokens
        sums["rollout_is_capped_fraction_tok_sum"] = m["rollout_is_capped_fraction"] * tokens
        sums["rollout_is_max"] = m["rollout_is_max"]
    return w, sums
