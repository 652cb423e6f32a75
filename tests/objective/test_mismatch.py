"""Training–inference mismatch (objective/mismatch.py, losses.rollout_is_weights): metrics and corrections
equal verl's formulas on shared random cases; non-finite engine log-probs never poison a step; the
extreme-ratio mask changes the loss exactly where it should; sums aggregate over micro-batches and
through the learner's step.

The references below are re-written in this file from the definitions in verl-project/verl,
verl/trainer/ppo/rollout_corr_helper.py (the rollout correction of verl 0.6 / 0.7, main of late 2025):
`compute_offpolicy_metrics`, `compute_is_metrics` (ratio fractions), `compute_rollout_correction_weights`
(TIS for a float threshold, IcePop for "lower_upper", `rollout_is_batch_normalize`) and
`compute_rollout_rejection_mask` (token_k1 / seq_sum_k1 / seq_mean_k1 and the k2 / k3 options), with
`verl.utils.torch_functional.masked_mean` = Σ v·m / (Σ m + 1e-8).
They work on verl's (B, S) rows with a response mask; our layout is a packed tree stream, so each
case is laid out as B single-path trees (one row each) and compared token by token.
"""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.objective.mismatch_dp_worker import normalised_steps, step_and_whole, train_config
from trace_mega.config import LossConfig
from trace_mega.objective.losses import LossBatch, compute_loss, rollout_is_weights
from trace_mega.objective.mismatch import mismatch_metrics, mismatch_sums, rollout_correction
from trace_mega.rollout.tree import Node, RolloutTree, pack

SAFETY_BOUND = 20.0  # verl's exp(±20) bound


# --- verl's formulas, on (B, S) rows --------------------------------------------------------------


def _mmean(v, m, axis=None):
    """verl_F.masked_mean."""
    if axis is None:
        return (v * m).sum() / (m.sum() + 1e-8)
    return (v * m).sum(axis) / (m.sum(axis) + 1e-8)


def verl_offpolicy_metrics(old, roll, m):
    """compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)."""
    mean_l = _mmean(old, m, -1)
    mean_r = _mmean(roll, m, -1)
    lr = old - roll
    diff = mean_r - mean_l
    rho = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq = (lr * m).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-mean_l).mean(),
        "kl": _mmean(roll - old, m),
        "k3_kl": _mmean(torch.exp(lr) - lr - 1, m),
        "rollout_ppl": torch.exp(-mean_r).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": _mmean(rho.square(), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0,
    }


def verl_ratio_fractions(old, roll, m, threshold=2.0):
    """compute_is_metrics (token level): rollout_is_ratio_fraction_high / _low of the raw weights, lower 1/threshold."""
    raw = torch.exp((old - roll).clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    return _mmean((raw > threshold).double(), m), _mmean((raw < 1.0 / threshold).double(), m)


def verl_is_weights(old, roll, m, level, threshold):
    """compute_rollout_correction_weights: (weights, rollout_is_oob_ratio or None); threshold float (TIS) or
    "lo_hi" (IcePop)."""
    lr = old - roll
    if level == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        raw = torch.exp((lr * m).sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr)
    raw = raw * m
    if isinstance(threshold, float):
        return raw.clamp(max=threshold), None
    lo, hi = (float(v) for v in threshold.split("_"))
    kept = (raw >= lo) & (raw <= hi)
    return torch.where(kept, raw, 0.0), _mmean((~kept).double(), m)


def verl_rejection_mask(old, roll, m, option, lo, hi):
    """compute_rollout_rejection_mask with token_k1 / seq_sum_k1 and threshold "lo_hi":
    (modified response mask, rollout_rs_masked_fraction)."""
    k1 = -(old - roll).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stat = k1 if option == "token_k1" else (k1 * m).sum(-1, keepdim=True).expand_as(k1)
    keep = ((stat >= math.log(lo)) & (stat <= math.log(hi))).double()
    return m * keep, _mmean(1.0 - keep, m)


def verl_divergence_rejection(old, roll, m, option, upper):
    """compute_rollout_rejection_mask with a k2 / k3 option (upper bound only) or seq_mean_k1 ("lo_hi" as
    ratio bounds on k1 = -log r; "median": a bound near the statistic's median): (modified response mask,
    rollout_rs_masked_fraction, the bound)."""
    lr = (old - roll).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    level, k = option.rsplit("_", 1)
    tok = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}[k]
    if level == "token":
        stat = tok
    elif level == "seq_sum":
        stat = (tok * m).sum(-1, keepdim=True).expand_as(tok)
    elif level == "seq_mean":
        stat = _mmean(tok, m, -1).unsqueeze(-1).expand_as(tok)
    else:  # seq_max over the response tokens
        stat = torch.where(m > 0, tok, -math.inf).amax(-1, keepdim=True).expand_as(tok)
    if k == "k1":
        lo, hi = (math.log(float(v)) for v in upper.split("_"))
        keep = ((stat >= lo) & (stat <= hi)).double()
    else:
        upper = _median_cut(stat, m) if upper == "median" else upper
        keep = (stat <= upper).double()
    return m * keep, _mmean(1.0 - keep, m), upper


def _median_cut(stat, m):
    """A bound halfway between two neighbouring values of `stat` on the response tokens, near their median
    (no value lies at it, so the fp32 and fp64 roundings of the same statistic fall on the same side)."""
    v = stat[m > 0].unique()
    i = max(len(v) // 2, 1)
    return float((v[i - 1] + v[min(i, len(v) - 1)]) / 2) if len(v) > 1 else float(v[0]) + 1.0


# --- shared random cases ---------------------------------------------------------------------------

CASES = [
    # (seed, rows B, row length S, log-ratio noise scale, extreme tokens per row)
    (0, 1, 1, 1e-3, 0),
    (1, 3, 7, 0.3, 0),
    (2, 8, 33, 1e-3, 1),
    (3, 5, 16, 1.0, 2),
    (4, 16, 64, 0.05, 3),
]


def _case(seed, B, S, scale, extreme):
    """(old, rollout, mask) (B, S) fp64: engine log-probs, the learner's off by noise (±5..15 nats on
    `extreme` tokens a row), a response mask with interior zeros (tool output) and right padding, every
    row with a loss token. The values are fp32-representable, as the packed stream stores them."""
    g = torch.Generator().manual_seed(seed)
    roll = -3.0 * torch.rand(B, S, generator=g, dtype=torch.float64)
    old = roll + scale * torch.randn(B, S, generator=g, dtype=torch.float64)
    for i in range(B):
        at = torch.randperm(S, generator=g)[:extreme]
        sign = torch.where(torch.rand(len(at), generator=g) < 0.5, -1.0, 1.0).double()
        old[i, at] = roll[i, at] + sign * (5.0 + 10.0 * torch.rand(len(at), generator=g, dtype=torch.float64))
    m = (torch.rand(B, S, generator=g) < 0.8).double()
    for i in range(B):
        pad = int(torch.randint(0, S, (1,), generator=g))
        m[i, S - pad :] = 0.0
        if m[i].sum() == 0:
            m[i, 0] = 1.0
    return old.float().double(), roll.float().double(), m


def _layout(old, roll, m):
    """B single-path trees holding the rows: (LossBatch, old (T,), engine (T,), rows (B, S) stream index)."""
    B, S = m.shape
    trees = []
    for i in range(B):
        t = RolloutTree(f"r{i}", [1, 2])
        leaf = t.add_node(0, Node(0, [3] * S, [int(v) for v in m[i]], [0.0] * S, kind="final"))
        t.nodes[leaf].reward = 0.0
        trees.append(t)
    p = pack(trees)
    rows = torch.stack([torch.arange(int(p.node_start[g]), int(p.node_end[g])) for g in p.leaf_nodes])
    old_s = torch.zeros(p.num_tokens)
    eng_s = torch.zeros(p.num_tokens)
    old_s[rows] = old.float()
    eng_s[rows] = roll.float()
    p.behaviour_logprobs = eng_s.clone()
    return LossBatch(p, torch.zeros(p.num_tokens)), old_s, eng_s, rows


def _metrics(old_s, eng_s, batch, cfg=None):
    _, sums = rollout_correction(old_s, eng_s, old_s, batch, cfg or LossConfig())
    return mismatch_metrics({k: v.item() for k, v in sums.items()})


@pytest.mark.parametrize("case", CASES)
def test_mismatch_metrics_equal_verl(case):
    old, roll, m = _case(*case)
    batch, old_s, eng_s, _ = _layout(old, roll, m)
    ours = _metrics(old_s, eng_s, batch)
    ref = verl_offpolicy_metrics(old, roll, m)
    names = {"kl": "kl", "k3": "k3_kl", "chi2_token": "chi2_token", "chi2_seq": "chi2_seq"}
    names |= {k: k for k in ("training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio")}
    for ours_name, verl_name in names.items():
        # chi2 = E[ρ²] − 1: compared as E[ρ²] (verl's masked_mean divides by Σm + 1e-8, a 1e-8 shift of E[ρ²])
        shift = 1.0 if ours_name.startswith("chi2") else 0.0
        got, want = ours[f"mismatch/{ours_name}"] + shift, ref[verl_name].item() + shift
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12), ours_name
    high, low = verl_ratio_fractions(old, roll, m)
    assert ours["mismatch/ratio_outside_frac"] == pytest.approx((high + low).item(), abs=1e-9)
    lr = (old - roll).abs()
    assert ours["mismatch/logprob_abs_max"] == pytest.approx(lr[m > 0].max().item(), rel=1e-12)
    assert ours["loss/logprob_mismatch"] == pytest.approx(_mmean(lr, m).item(), rel=1e-6)
    assert ours["mismatch/nonfinite_frac"] == 0.0 and ours["mismatch/masked_frac"] == 0.0
    if case[4]:  # extreme tokens are out of [0.5, 2], and the chi2 / k3 see them
        assert ours["mismatch/ratio_outside_frac"] > 0 and ours["mismatch/logprob_abs_max"] > 5.0


def test_tree_metrics_count_a_shared_token_once_and_a_path_over_all_its_tokens():
    """On a branching tree: token metrics are verl's over the stream's loss tokens (a shared prefix once),
    path metrics verl's over the flattened root-to-leaf rows."""
    trees = []
    for i, n in enumerate((3, 5)):
        t = RolloutTree(f"p{i}", [1, 2, 3])
        a = t.add_node(0, Node(0, [4] * (2 + i), [1] * (2 + i), [0.0] * (2 + i)))
        t.add_path(a, [Node(0, [5] * n, [1] * (n - 1) + [0], [0.0] * n)], 1.0)
        t.add_path(a, [Node(0, [6] * 2, [1, 1], [0.0] * 2), Node(0, [7] * 4, [0, 1, 1, 1], [0.0] * 4)], 0.0)
        t.add_path(0, [Node(0, [8] * 3, [1] * 3, [0.0] * 3)], 0.0)
        trees.append(t)
    p = pack(trees)
    g = torch.Generator().manual_seed(7)
    eng = -2.0 * torch.rand(p.num_tokens, generator=g)
    old = eng + 0.4 * torch.randn(p.num_tokens, generator=g)
    p.behaviour_logprobs = eng
    batch = LossBatch(p, torch.zeros(p.num_tokens))
    ours = _metrics(old, eng, batch)
    m = p.loss_mask.double()[None]
    tok = verl_offpolicy_metrics(old.double()[None], eng.double()[None], m)
    assert ours["mismatch/k3"] == pytest.approx(tok["k3_kl"].item(), rel=1e-6)
    assert ours["mismatch/kl"] == pytest.approx(tok["kl"].item(), rel=1e-6)
    flat = p.flatten()
    idx = flat.packed_index.clamp(min=0)
    fm = flat.loss_mask.double()
    path = verl_offpolicy_metrics(old.double()[idx], eng.double()[idx], fm)
    for k in ("training_ppl", "rollout_ppl", "log_ppl_diff", "ppl_ratio", "chi2_seq"):
        assert ours[f"mismatch/{k}"] == pytest.approx(path[k].item(), rel=1e-6), k
    # the flattened rows repeat the shared prefixes, so their token k3 differs from the stream's
    assert verl_offpolicy_metrics(old.double()[idx], eng.double()[idx], fm)["k3_kl"].item() != pytest.approx(
        ours["mismatch/k3"], rel=1e-3
    )


# --- corrections ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.8, 1.25)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_equals_verl(case, bounds, level):
    """rollout_is: level with cap = hi and rollout_mask: level with [lo, hi] is verl's IcePop, threshold "lo_hi"."""
    old, roll, m = _case(*case)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    lo, hi = bounds
    w, met = rollout_is_weights(old_s, eng_s, batch, level, hi, level, bounds)
    ref, oob = verl_is_weights(old, roll, m, level, f"{lo}_{hi}")
    on = m > 0
    torch.testing.assert_close(w[rows][on].double(), ref[on], rtol=1e-5, atol=1e-9)
    assert met["masked_fraction"].item() == pytest.approx(oob.item(), abs=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_equals_verl(case, level):
    old, roll, m = _case(*case)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    w, met = rollout_is_weights(old_s, eng_s, batch, level, 2.0)
    ref, _ = verl_is_weights(old, roll, m, level, 2.0)
    on = m > 0
    torch.testing.assert_close(w[rows][on].double(), ref[on], rtol=1e-5, atol=1e-8)
    assert met["masked_fraction"].item() == 0.0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.7, 1.1)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mask_alone_equals_verl_rejection(case, bounds, level):
    """rollout_mask alone (MIS: weight 1 kept, 0 rejected) is verl's token_k1 / seq_sum_k1 rejection; verl's
    k1 = log(π_rollout/π_old) is bounded, ours log(π_old/π_rollout), so its bounds are (1/hi, 1/lo)."""
    old, roll, m = _case(*case)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    w, met = rollout_is_weights(old_s, eng_s, batch, "none", 2.0, level, bounds)
    option = "token_k1" if level == "token" else "seq_sum_k1"
    keep, frac = verl_rejection_mask(old, roll, m, option, 1.0 / bounds[1], 1.0 / bounds[0])
    on = m > 0
    torch.testing.assert_close(w[rows][on].double(), keep[on], rtol=0, atol=0)
    assert met["masked_fraction"].item() == pytest.approx(frac.item(), abs=1e-6)
    assert (w[~batch.packed.loss_mask] == 1.0).all()  # off the loss mask nothing is weighted


REJECTIONS = [
    "token_k2",
    "token_k3",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("option", REJECTIONS)
@pytest.mark.parametrize("upper", [0.01, 0.5, "median"])
def test_divergence_rejection_equals_verl(case, option, upper):
    """rollout_reject alone is verl's rollout_rs k2 / k3 rejection (weight 1 kept, 0 rejected); "median":
    a bound that rejects about half of the tokens or rows."""
    old, roll, m = _case(*case)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    keep, frac, bound = verl_divergence_rejection(old, roll, m, option, upper)
    w, met = rollout_is_weights(old_s, eng_s, batch, "none", 2.0, reject=option, reject_max=bound)
    on = m > 0
    torch.testing.assert_close(w[rows][on].double(), keep[on], rtol=0, atol=0)
    assert met["masked_fraction"].item() == pytest.approx(frac.item(), abs=1e-6)
    assert (w[~batch.packed.loss_mask] == 1.0).all()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.9, 1.05)])
def test_geometric_mask_equals_verl_seq_mean_k1(case, bounds):
    """rollout_mask: geometric is verl's seq_mean_k1 (geometric-mean ratio) rejection; as for token_k1 its
    bounds on k1 = -log r are ours reversed."""
    old, roll, m = _case(*case)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    w, met = rollout_is_weights(old_s, eng_s, batch, "none", 2.0, "geometric", bounds)
    keep, frac, _ = verl_divergence_rejection(old, roll, m, "seq_mean_k1", f"{1.0 / bounds[1]}_{1.0 / bounds[0]}")
    on = m > 0
    torch.testing.assert_close(w[rows][on].double(), keep[on], rtol=0, atol=0)
    assert met["masked_fraction"].item() == pytest.approx(frac.item(), abs=1e-6)


def _two_path_tree():
    """A shared 2-token prefix (log-ratio 0.1 a token) under two leaves (1 token at 0.9; 2 at -0.05), engine
    log-probs 0: (packed, shared node, leaf 1, leaf 2, old (T,), LossBatch, engine (T,))."""
    t = RolloutTree("x", [1, 2])
    a = t.add_node(0, Node(0, [3, 4], [1, 1], [0.0, 0.0]))
    t.add_path(a, [Node(0, [5], [1], [0.0])], 1.0)
    t.add_path(a, [Node(0, [6, 7], [1, 1], [0.0, 0.0])], 0.0)
    p = pack([t])
    leaf1, leaf2 = p.leaf_nodes.tolist()
    shared = int(p.node_parent[leaf1])
    old = torch.zeros(p.num_tokens)
    for node, val in ((shared, 0.1), (leaf1, 0.9), (leaf2, -0.05)):  # per-token log ratios
        old[int(p.node_start[node]) : int(p.node_end[node])] = val
    batch = LossBatch(p, torch.zeros(p.num_tokens))
    eng = torch.zeros(p.num_tokens)
    return p, shared, leaf1, leaf2, old, batch, eng


def test_rejection_multiplies_the_other_factors_and_shares_a_prefix_over_its_paths():
    """On a tree: a path rejected by seq_max_k3 zeroes its own tokens, halves the shared prefix's keep, and
    multiplies into token IS there; an unknown option is refused, naming the valid ones."""
    p, shared, leaf1, leaf2, old, batch, eng = _two_path_tree()
    # k3(0.9) = e^0.9 − 1.9 ≈ 0.56 rejects path 1 at M = 0.1; path 2's largest k3 is k3(0.1) ≈ 0.0052
    w, met = rollout_is_weights(old, eng, batch, "token", 2.0, reject="seq_max_k3", reject_max=0.1)
    s, l1, l2 = (int(p.node_start[n]) for n in (shared, leaf1, leaf2))
    assert w[s].item() == pytest.approx(0.5 * math.exp(0.1))
    assert w[l1].item() == 0.0 and w[l2].item() == pytest.approx(math.exp(-0.05))
    assert met["masked_fraction"].item() == pytest.approx((0.5 * 2 + 1.0) / 5)
    with pytest.raises(ValueError, match="seq_mean_k3"):
        rollout_is_weights(old, eng, batch, "none", 2.0, reject="seq_k3")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_batch_normalised_weights_equal_verl(case, level, threshold):
    """w / (is_norm_sum / is_norm_count) is verl's rollout_is_batch_normalize: truncated (or IcePop) weights
    over their mean per token, or per sequence over the rows."""
    old, roll, m = _case(*case)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    icepop = isinstance(threshold, str)
    w, met = rollout_is_weights(old_s, eng_s, batch, level, 2.0, level if icepop else "none", (0.5, 2.0))
    ref, _ = verl_is_weights(old, roll, m, level, threshold)
    if level == "token":
        mean = _mmean(ref, m)
    else:
        mean = _mmean(ref, m, -1)[m.sum(-1) > 0].mean()
    on = m > 0
    ours = w[rows][on].double() / (met["is_norm_sum"] / met["is_norm_count"]).double()
    # atol: verl floors a sequence's log-ratio at -20 (weights of ~1e-9 where ours are ~0)
    torch.testing.assert_close(ours, (ref / mean)[on], rtol=1e-5, atol=1e-7)


def _check_normalised(pairs, mean):
    """The loss (at the pre-update weights; lr 1e-8) is the plain one over the whole batch's mean IS weight,
    also in 2 mini-batches: one mean for the step, not one per mini-batch or micro-batch."""
    assert mean != pytest.approx(1.0, abs=1e-3)
    for plain, normed in pairs:
        assert normed["loss/rollout_is_norm_factor"] == pytest.approx(mean, rel=1e-5)
        assert normed["loss/total"] == pytest.approx(plain["loss/total"] / mean, rel=1e-4)
        assert normed["loss/rollout_is_mean"] == pytest.approx(plain["loss/rollout_is_mean"] / mean, rel=1e-5)


def test_learner_normalises_the_weights_over_the_whole_batch(learner):
    """Through `Learner.train_step` (1 or 2 mini-batches of several micro-batches): every micro-batch divides
    its weights by the same, whole-batch mean, which the step reports."""
    _check_normalised(*normalised_steps(learner))


def test_sequence_weights_on_a_tree_are_the_mean_over_the_paths_through_a_token():
    p, shared, leaf1, leaf2, old, batch, eng = _two_path_tree()
    # path 1: D = 0.2 + 0.9 = 1.1 (ratio 3.0, masked by [0.5, 2]); path 2: D = 0.2 − 0.1 = 0.1 (kept)
    w, met = rollout_is_weights(old, eng, batch, "sequence", 2.0, "sequence", (0.5, 2.0))
    s, l1, l2 = (int(p.node_start[n]) for n in (shared, leaf1, leaf2))
    assert w[s].item() == pytest.approx(0.5 * math.exp(0.1))  # (0 + e^0.1) / 2 paths
    assert w[l1].item() == 0.0 and w[l2].item() == pytest.approx(math.exp(0.1))
    assert met["masked_fraction"].item() == pytest.approx((0.5 * 2 + 1.0) / 5)  # shared half-kept, leaf 1 out


# --- non-finite engine log-probs ------------------------------------------------------------------


@pytest.mark.parametrize("old_logprobs", ["learner", "behaviour"])
def test_nonfinite_engine_logprobs_are_masked_and_counted(old_logprobs):
    old, roll, m = _case(3, 5, 16, 1.0, 2)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    on = (m > 0).nonzero()
    bad = on[torch.tensor([0, 3, 7, 11])]  # four loss tokens: NaN, +inf, -inf, NaN
    bad_stream = rows[bad[:, 0], bad[:, 1]]
    for i, v in zip(bad_stream.tolist(), (math.nan, math.inf, -math.inf, math.nan)):
        eng_s[i] = v
    eng_s[~batch.packed.loss_mask] = math.nan  # garbage off the loss mask is never read
    batch.packed.behaviour_logprobs = eng_s
    m_ok = m.clone()
    m_ok[bad[:, 0], bad[:, 1]] = 0.0
    cfg = LossConfig(old_logprobs=old_logprobs)
    if old_logprobs == "learner":
        cfg = dataclasses.replace(cfg, rollout_is="token", rollout_mask="token")
    ref_old = old_s if old_logprobs == "learner" else eng_s
    w, sums = rollout_correction(ref_old, eng_s, old_s, batch, cfg)
    ours = mismatch_metrics({k: v.item() for k, v in sums.items()})
    assert all(math.isfinite(v) for v in ours.values()), ours
    ref = verl_offpolicy_metrics(old, roll, m_ok)  # the same metrics with those tokens left out
    assert ours["mismatch/k3"] == pytest.approx(ref["k3_kl"].item(), rel=1e-6)
    assert ours["mismatch/ppl_ratio"] == pytest.approx(ref["ppl_ratio"].item(), rel=1e-6)
    assert ours["mismatch/nonfinite_frac"] == pytest.approx(4 / m.sum().item())
    assert ours["mismatch/masked_frac"] >= 4 / m.sum().item()
    assert (w[bad_stream] == 0).all() and torch.isfinite(w).all()
    # the loss and its gradient stay finite, and the non-finite tokens get no gradient
    adv = torch.randn(batch.packed.num_tokens, generator=torch.Generator().manual_seed(0))
    lb = LossBatch(batch.packed, torch.where(batch.packed.loss_mask, adv, 0.0))
    lp = (old_s + 0.01).requires_grad_()
    out = compute_loss(lp, lb, cfg, old_logprobs=ref_old, is_weights=w)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert (lp.grad[bad_stream] == 0).all()


# --- the mask changes the loss exactly where tokens are out of bounds -----------------------------


def _grad(batch, lp0, old, cfg, w):
    lp = lp0.clone().requires_grad_()
    out = compute_loss(lp, batch, cfg, old_logprobs=old, is_weights=w)
    out.loss.backward()
    return out.loss.detach(), lp.grad


@pytest.mark.parametrize("name", ["ppo_clip_token", "gspo"])
def test_mask_changes_the_loss_only_when_tokens_are_out_of_bounds(name):
    old, roll, m = _case(1, 3, 7, 0.3, 0)
    batch, old_s, eng_s, rows = _layout(old, roll, m)
    g = torch.Generator().manual_seed(1)
    adv = torch.where(batch.packed.loss_mask, torch.randn(batch.packed.num_tokens, generator=g), 0.0)
    lb = LossBatch(batch.packed, adv)
    lp0 = old_s.clone()  # ratio 1: no clip acts, every loss token with A ≠ 0 has a gradient
    plain = LossConfig(name=name)
    masked = dataclasses.replace(plain, rollout_mask="token", rollout_mask_low=0.5, rollout_mask_high=2.0)
    # all ratios inside: the mask weighs nothing (bit-identical loss and gradient)
    inside = old_s + 0.5 * (eng_s - old_s).clamp(-0.3, 0.3)  # |log ratio| ≤ 0.3 < log 2
    w_plain, _ = rollout_correction(old_s, inside, old_s, lb, plain)
    w_mask, sums = rollout_correction(old_s, inside, old_s, lb, masked)
    assert sums["mismatch_masked_sum"].item() == 0.0
    loss_a, grad_a = _grad(lb, lp0, old_s, plain, w_plain)
    loss_b, grad_b = _grad(lb, lp0, old_s, masked, w_mask)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    # some ratios outside: those tokens lose their gradient, the loss changes
    outside = inside.clone()
    out_tok = rows[m > 0][:3]
    outside[out_tok] = old_s[out_tok] - torch.tensor([1.0, -1.0, 2.0])  # ratios e, 1/e, e^2
    w_plain, _ = rollout_correction(old_s, outside, old_s, lb, plain)
    w_mask, sums = rollout_correction(old_s, outside, old_s, lb, masked)
    assert sums["mismatch_masked_sum"].item() == 3.0
    loss_a, grad_a = _grad(lb, lp0, old_s, plain, w_plain)
    loss_b, grad_b = _grad(lb, lp0, old_s, masked, w_mask)
    assert not torch.equal(loss_a, loss_b)
    assert (grad_b[out_tok] == 0).all() and (grad_a[out_tok] != 0).all()
    if name == "ppo_clip_token":  # token losses: every other token's gradient is untouched
        keep = batch.packed.loss_mask.clone()
        keep[out_tok] = False
        torch.testing.assert_close(grad_a[keep], grad_b[keep], rtol=0, atol=0)


# --- aggregation ----------------------------------------------------------------------------------


def test_sums_over_micro_batches_equal_the_whole_batch():
    trees = []
    g = torch.Generator().manual_seed(3)
    for i in range(5):
        t = RolloutTree(f"p{i}", [1, 2])
        a = t.add_node(0, Node(0, [3] * (2 + i), [1] * (2 + i), [0.0] * (2 + i)))
        t.add_path(a, [Node(0, [4] * 3, [1, 1, 0], [0.0] * 3)], 1.0)
        t.add_path(a, [Node(0, [5] * (1 + i), [1] * (1 + i), [0.0] * (1 + i))], 0.0)
        trees.append(t)
    p = pack(trees)
    eng = -2.0 * torch.rand(p.num_tokens, generator=g)
    old = eng + 0.7 * torch.randn(p.num_tokens, generator=g)
    whole = {k: v.item() for k, v in mismatch_sums(old, eng, p).items()}
    total: dict[str, float] = {}
    for part in ([0, 3], [1], [2, 4]):
        toks = p.tree_tokens(part)
        sub = p.select(part)
        for k, v in mismatch_sums(old[toks], eng[toks], sub).items():
            total[k] = max(total.get(k, -math.inf), v.item()) if k.endswith("_max") else total.get(k, 0.0) + v.item()
    whole["mismatch_masked_sum"] = total["mismatch_masked_sum"] = 0.0
    a, b = mismatch_metrics(whole), mismatch_metrics(total)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-12), k


@pytest.fixture(scope="module")
def learner():
    from trace_mega.learner.learner import Learner
    from trace_mega.learner.parallel import destroy_parallel

    ln = Learner(train_config())
    yield ln
    destroy_parallel()


def _check_step(step, whole, tokens):
    assert step["loss/skipped"] == 0.0 and step["loss/optimizer_steps"] == 2.0
    for k, v in whole.items():
        assert step[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert step["mismatch/nonfinite_frac"] == pytest.approx(1 / tokens)
    assert step["mismatch/masked_frac"] > step["mismatch/nonfinite_frac"] > 0.0
    assert step["mismatch/ratio_outside_frac"] > 0.0 and step["loss/rollout_is_mean"] < 1.5


def test_learner_step_reports_the_whole_batch_metrics_and_survives_nan_engine_logprobs(learner):
    """Through `Learner.train_step` (2 mini-batches, several micro-batches): the step's mismatch/* equal the
    metrics of the whole batch at once, a NaN engine log-prob is counted and the update is not skipped,
    and the token mask reports what it masked."""
    _check_step(*step_and_whole(learner))


@pytest.mark.slow
def test_data_parallel_step_reports_the_whole_batch_metrics(tmp_path):
    """DP = 2 (torchrun, gloo): each rank sums its share, the all-reduce adds them, the step's metrics are
    still those of the whole batch; batch-normalised IS divides by the mean over both ranks' shares."""
    from trace_mega.kernels._triton_env import env_without_interpreter
    from trace_mega.learner.parallel import free_port

    out = tmp_path / "dp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(Path(__file__).parent / "mismatch_dp_worker.py"), str(out)]
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dp"] == 2
    _check_step(res["step"], res["whole"], res["tokens"])
    _check_normalised(*res["normalised"])  # the mean over both ranks' shares
