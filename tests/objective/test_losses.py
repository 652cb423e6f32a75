"""Losses (losses.py): direct formulas on flat data, flattened equivalence on trees, micro-batching."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_mega.config import AdvantageConfig, LossConfig
from trace_mega.objective.advantages import compute_advantages
from trace_mega.objective.losses import (
    LOSSES,
    LossBatch,
    aggregation_coefficients,
    aggregation_mode,
    compute_loss,
    kl_k3,
    path_token_index,
    unit_count,
)
from trace_mega.rollout.tree import Node, RolloutTree, pack


def _tree(spec, pid="t"):
    """spec rows: (parent, n tokens, reward or None)."""
    t = RolloutTree(pid, [1, 2])
    for parent, n, reward in spec:
        nid = t.add_node(parent, Node(parent, [3] * n, [1] * n, [0.0] * n, kind="tool" if reward is None else "final"))
        if reward is not None:
            t.nodes[nid].reward = float(reward)
    return t


# Flat data: tree 0 has paths of 3 and 2 generated tokens, tree 1 one path of 4 tokens.
X = [[math.log(1.25), 0.1, -0.3], [math.log(0.7), 0.05], [0.0, math.log(1.1), -0.02, 0.4]]
ADV = [1.0, -2.0, 0.5]
TREE_OF_PATH = [0, 0, 1]


def _flat_batch():
    trees = [_tree([(0, 3, 1), (0, 2, 0)], "a"), _tree([(0, 4, 1)], "b")]
    p = pack(trees)
    old = torch.linspace(-2.0, -1.0, p.num_tokens)
    p.behaviour_logprobs = torch.where(p.loss_mask, old, 0.0)
    logp = p.behaviour_logprobs.clone()
    adv = torch.zeros(p.num_tokens)
    for i, leaf in enumerate(p.leaf_nodes.tolist()):
        s, e = int(p.node_start[leaf]), int(p.node_end[leaf])
        logp[s:e] += torch.tensor(X[i])
        adv[s:e] = ADV[i]
    return LossBatch(p, adv, p.loss_mask.float()), logp


def _direct(b, logp, kind, eps):
    """The textbook formulas, one explicit loop over paths and tokens."""
    p, terms, lengths = b.packed, [], []
    for i, leaf in enumerate(p.leaf_nodes.tolist()):
        s, e = int(p.node_start[leaf]), int(p.node_end[leaf])
        x = logp[s:e] - p.behaviour_logprobs[s:e]
        A = ADV[i]
        if kind == "gspo":
            sp = torch.exp(x.mean())
            terms.append(-torch.minimum(sp * A, sp.clamp(1 - eps[0], 1 + eps[1]) * A))
        else:
            r = torch.exp(x)
            terms.append(-torch.minimum(r * A, r.clamp(1 - eps[0], 1 + eps[1]) * A))
        lengths.append(e - s)
    if kind == "gspo":
        return torch.stack(terms).mean()
    if kind == "seq_sum_norm":
        return torch.stack([t.sum() / NORM for t in terms]).mean()
    if kind == "token_mean":
        return torch.cat(terms).sum() / sum(lengths)
    if kind == "sequence_mean":
        return torch.stack([t.mean() for t in terms]).mean()
    per_tree = []
    for tr in (0, 1):
        idx = [i for i, t in enumerate(TREE_OF_PATH) if t == tr]
        per_tree.append(torch.cat([terms[i] for i in idx]).sum() / sum(lengths[i] for i in idx))
    return torch.stack(per_tree).mean()


CASES = [  # (loss name, aggregation, direct kind, (eps_low, eps_high) it must use by default)
    ("ppo_clip_token", None, "token_mean", (0.2, 0.2)),
    ("ppo_clip_token", "sequence_mean", "sequence_mean", (0.2, 0.2)),
    ("ppo_clip_token", "prompt_mean", "prompt_mean", (0.2, 0.2)),
    ("dapo", None, "token_mean", (0.2, 0.28)),
    ("gspo", None, "gspo", (3e-4, 4e-4)),
    ("ppo_clip_token", "seq_mean_token_sum_norm", "seq_sum_norm", (0.2, 0.2)),
]
NORM = 16  # seq_norm_tokens of the Dr.GRPO aggregation in these tests


def _cfg(name, agg, **kw):
    return LossConfig(
        name=name, aggregation=agg, seq_norm_tokens=NORM if agg == "seq_mean_token_sum_norm" else None, **kw
    )


@pytest.mark.parametrize("name,agg,kind,eps", CASES)
def test_losses_match_direct_formulas_on_flat_data(name, agg, kind, eps):
    p, logp = _flat_batch()
    a = logp.clone().requires_grad_(True)
    out = compute_loss(a, p, _cfg(name, agg))
    out.loss.backward()
    b = logp.clone().requires_grad_(True)
    ref = _direct(p, b, kind, eps)
    ref.backward()
    assert torch.allclose(out.loss, ref, atol=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert a.grad[~p.packed.loss_mask].abs().max() == 0


def test_clip_higher_changes_what_is_clipped():
    b, logp = _flat_batch()
    p = b.packed
    # token 0 of path 0: ratio 1.25 with A > 0 is clipped at 1.2 (GRPO) but not at 1.28 (DAPO)
    tok = int(p.node_start[p.leaf_nodes[0]])
    grads = {}
    for name in ("ppo_clip_token", "dapo"):
        a = logp.clone().requires_grad_(True)
        compute_loss(a, b, LossConfig(name=name)).loss.backward()
        grads[name] = a.grad[tok].item()
    assert grads["ppo_clip_token"] == 0.0
    assert grads["dapo"] == pytest.approx(-1.25 * 1.0 / 9)  # -r A / (9 tokens)


def test_kl_k3_and_entropy_bonus():
    q = torch.tensor([math.log(2.0), -math.log(2.0), 0.0])
    assert torch.allclose(kl_k3(torch.zeros(3), q), torch.tensor([1 - math.log(2), 0.5 + math.log(2) - 1, 0.0]))
    b, logp = _flat_batch()
    p = b.packed
    ref = logp + 0.3 * torch.sin(torch.arange(p.num_tokens, dtype=torch.float32))
    ent = torch.rand(p.num_tokens, generator=torch.Generator().manual_seed(1))
    base = compute_loss(logp, b, LossConfig()).loss
    out = compute_loss(logp, b, LossConfig(kl_coef=0.1, entropy_coef=0.01), ref_logprobs=ref, entropy=ent)
    m = p.loss_mask
    kl = kl_k3(logp[m], ref[m]).mean()
    assert torch.allclose(out.loss, base + 0.1 * kl - 0.01 * ent[m].mean(), atol=1e-6)
    assert torch.allclose(out.metrics["kl_ref"], kl)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(logp, b, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(logp, b, LossConfig(entropy_coef=0.1))


def _shared_batch(trees, seed=0):
    p = pack(trees)
    adv = compute_advantages(p, trees, AdvantageConfig(name="tree", shared_token_weight="per_leaf"))
    g = torch.Generator().manual_seed(seed)
    old = -1.0 - torch.rand(p.num_tokens, generator=g)
    p.behaviour_logprobs = torch.where(p.loss_mask, old, 0.0)
    logp = p.behaviour_logprobs + torch.where(p.loss_mask, 0.3 * torch.randn(p.num_tokens, generator=g), 0.0)
    return adv.loss_batch(p), logp


def _trees():
    return [
        _tree([(0, 3, None), (1, 2, 1), (1, 3, None), (3, 1, 0), (3, 2, 1), (0, 2, 0)], "x"),
        _tree([(0, 2, 1), (0, 4, None), (2, 2, 0), (2, 1, 0)], "y"),
    ]


def _flattened(b, logp, kind, eps):
    """Loss on the flattened paths (one row per trajectory, every token weight 1)."""
    p = b.packed
    f = p.flatten()
    idx, m = f.packed_index.clamp(min=0), f.loss_mask
    x = torch.where(m, logp[idx] - p.behaviour_logprobs[idx], 0.0)  # (L, S)
    A = torch.where(m, b.advantages[idx], 0.0)
    mf, n = m.float(), m.float().sum(1)
    if kind == "gspo":
        s = torch.exp((x * mf).sum(1) / n)  # (L,)
        s_t = s.detach()[:, None] * torch.exp(x - x.detach())
        term = torch.minimum(s_t * A, s_t.clamp(1 - eps[0], 1 + eps[1]) * A)
        return -((term * mf).sum(1) / n).mean()
    r = torch.exp(x)
    ell = -torch.minimum(r * A, r.clamp(1 - eps[0], 1 + eps[1]) * A) * mf  # (L, S)
    if kind == "token_mean":
        return ell.sum() / mf.sum()
    if kind == "seq_sum_norm":
        return (ell.sum(1) / NORM).mean()
    if kind == "sequence_mean":
        return (ell.sum(1) / n).mean()
    tree = p.node_tree[f.leaf_node]
    per = [ell[tree == b].sum() / mf[tree == b].sum() for b in range(p.num_trees)]
    return torch.stack(per).mean()


@pytest.mark.parametrize("name,agg,kind,eps", CASES)
def test_packed_tree_with_per_leaf_weights_equals_flattened_paths(name, agg, kind, eps):
    p, logp = _shared_batch(_trees())
    assert p.packed.compression_ratio() > 1.3  # the batch really shares prefixes
    a = logp.clone().requires_grad_(True)
    out = compute_loss(a, p, _cfg(name, agg))
    out.loss.backward()
    b = logp.clone().requires_grad_(True)
    ref = _flattened(p, b, kind, eps)
    ref.backward()
    assert torch.allclose(out.loss, ref, atol=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_path_token_index_equals_flatten():
    for trees in (_trees(), [_tree([(0, 3, 1)])], _trees()[:1]):
        p = pack(trees)
        assert torch.equal(path_token_index(p), p.flatten().packed_index)


def test_aggregation_mode_names_the_unit_of_each_loss():
    assert aggregation_mode(LossConfig()) == "token_mean"
    assert aggregation_mode(LossConfig(aggregation="prompt_mean")) == "prompt_mean"
    assert aggregation_mode(LossConfig(name="dapo")) == "token_mean"
    assert aggregation_mode(LossConfig(name="gspo")) == "sequence_mean"


def test_once_weights_count_a_shared_token_once():
    trees = _trees()
    p = pack(trees)
    b = compute_advantages(p, trees, AdvantageConfig(name="tree")).loss_batch(p)
    coef = aggregation_coefficients(b, "token_mean")
    m = p.loss_mask
    assert torch.allclose(coef[m], torch.full((int(m.sum()),), 1.0 / int(m.sum())))
    # sequence_mean with weight 1: a token's unit is split over its n paths: Σ_t c_t == 1
    assert torch.allclose(aggregation_coefficients(b, "sequence_mean").sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    "name,agg",
    [
        ("ppo_clip_token", None),
        ("ppo_clip_token", "sequence_mean"),
        ("ppo_clip_token", "prompt_mean"),
        ("gspo", None),
        ("ppo_clip_token", "seq_mean_token_sum_norm"),
    ],
)
def test_micro_batches_with_global_units_sum_to_the_batch_loss(name, agg):
    trees = _trees() + [_tree([(0, 2, 1), (0, 3, 0)], "z")]
    cfg = _cfg(name, agg)
    mode = aggregation_mode(cfg)
    b, logp = _shared_batch(trees, seed=3)
    full = compute_loss(logp, b, cfg).loss
    micro, offset = [], 0
    for part in (trees[:2], trees[2:]):  # micro-batches hold whole trees
        q = pack(part)
        sl = slice(offset, offset + q.num_tokens)
        q.behaviour_logprobs = b.packed.behaviour_logprobs[sl]
        micro.append((LossBatch(q, b.advantages[sl], b.token_weight[sl]), sl))
        offset += q.num_tokens
    total_units = sum(float(unit_count(q, mode)) for q, _ in micro)
    parts = [compute_loss(logp[sl], q, cfg, global_units=total_units).loss for q, sl in micro]
    assert torch.allclose(sum(parts), full, atol=1e-6)


def test_validation():
    p, logp = _flat_batch()
    assert LOSSES.names() == ["dapo", "gspo", "ppo_clip_token"]
    with pytest.raises(ValueError, match="token_mean"):
        compute_loss(logp, p, LossConfig(name="dapo", aggregation="sequence_mean"))
    with pytest.raises(ValueError, match="sequence_mean"):
        compute_loss(logp, p, LossConfig(name="gspo", aggregation="token_mean"))
    with pytest.raises(ValueError, match="aggregation"):
        aggregation_coefficients(p, "batch_mean")
    with pytest.raises(ValueError, match="seq_norm_tokens"):
        compute_loss(logp, p, LossConfig(aggregation="seq_mean_token_sum_norm"))


# --- numerical guards -------------------------------------------------------------------------
def _all_loss_configs(**kw):
    for name in LOSSES.names():
        aggs = {"dapo": [None], "gspo": [None]}.get(
            name, [None, "sequence_mean", "prompt_mean", "seq_mean_token_sum_norm"]
        )
        for agg in aggs:
            yield _cfg(name, agg, **kw)


@pytest.mark.parametrize("dual_clip_c", [3.0, None])
def test_extreme_ratios_give_finite_losses_and_gradients_in_every_loss(dual_clip_c):
    b, _ = _shared_batch(_trees())
    p = b.packed
    g = torch.Generator().manual_seed(5)
    sign = torch.where(torch.rand(p.num_tokens, generator=g) < 0.5, -1.0, 1.0)
    logp = p.behaviour_logprobs + torch.where(p.loss_mask, 90.0 * sign, 0.0)  # ratios e^±90
    adv = torch.where(p.loss_mask, torch.randn(p.num_tokens, generator=g), 0.0)  # both signs
    p = LossBatch(p, adv, b.token_weight)
    ent = torch.rand(p.packed.num_tokens, generator=g)
    seen = set()
    for cfg in _all_loss_configs(kl_coef=0.1, entropy_coef=0.01, dual_clip_c=dual_clip_c):
        seen.add(cfg.name)
        a = logp.clone().requires_grad_(True)
        out = compute_loss(a, p, cfg, ref_logprobs=p.packed.behaviour_logprobs, entropy=ent)
        out.loss.backward()
        assert torch.isfinite(out.loss), (cfg.name, cfg.aggregation)
        assert bool(torch.isfinite(a.grad).all()), (cfg.name, cfg.aggregation)
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values()), (cfg.name, out.metrics)
        if cfg.name != "gspo":  # a token ratio, clamped at e^20 (gspo's is a per-path mean)
            assert float(out.metrics["ratio_max"]) == pytest.approx(math.exp(20.0), rel=1e-5)
    assert seen == set(LOSSES.names())


def test_dual_clip_bounds_the_loss_of_a_negative_advantage():
    b, logp = _flat_batch()
    p = b.packed
    tok = int(p.node_start[p.leaf_nodes[1]])  # path 1 has A = -2
    lp = logp.clone()
    lp[tok] = p.behaviour_logprobs[tok] + math.log(5.0)  # ratio 5 > c = 3
    n = int(p.loss_mask.sum())
    terms = {}
    for c in (3.0, None):
        a = lp.clone().requires_grad_(True)
        out = compute_loss(a, b, LossConfig(dual_clip_c=c))
        out.loss.backward()
        terms[c] = (out.loss.item(), a.grad[tok].item(), out.metrics["dual_clip_fraction"].item())
    base = compute_loss(lp, b, LossConfig(dual_clip_c=None)).loss.item()
    # without dual-clip the token's loss is r|A| = 10; with c = 3 it is c|A| = 6, with no gradient
    assert terms[None][0] - terms[3.0][0] == pytest.approx((10.0 - 6.0) / n, rel=1e-5)
    assert terms[3.0][1] == 0.0 and terms[None][1] != 0.0
    assert terms[3.0][2] == pytest.approx(1.0 / n) and terms[None][2] == 0.0
    assert terms[None][0] == pytest.approx(base)


def test_kl_clamp_bounds_the_k3_term():
    lp = torch.tensor([0.0, 0.0])
    ref = torch.tensor([5.0, 0.1])  # k3 = e^5 - 6 ≈ 142 and ≈ 0.005
    assert torch.allclose(kl_k3(lp, ref, clamp=10.0), torch.stack([torch.tensor(10.0), kl_k3(lp, ref)[1]]))
    assert kl_k3(lp, ref)[0] > 100
    assert torch.isfinite(kl_k3(torch.zeros(1), torch.tensor([200.0])))  # q clamped to 20 before exp


def test_ratio_metrics_report_the_max_and_k3_of_the_ratio():
    b, logp = _flat_batch()
    p = b.packed
    out = compute_loss(logp, b, LossConfig())
    x = (logp - p.behaviour_logprobs)[p.loss_mask]
    assert out.metrics["ratio_max"].item() == pytest.approx(math.exp(float(x.max())), rel=1e-6)
    assert out.metrics["approx_kl"].item() == pytest.approx(float((x.exp() - 1 - x).mean()), rel=1e-5)


# --- random trees ------------------------------------------------------------------------------


@st.composite
def random_forest(draw):
    trees = []
    for ti in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 8))
        parents = [draw(st.integers(0, i)) for i in range(n)]
        inner = set(parents)
        trees.append(
            _tree(
                [
                    (p, draw(st.integers(1, 3)), None if i in inner else float(draw(st.integers(0, 1))))
                    for i, p in enumerate(parents, start=1)
                ],
                f"r{ti}",
            )
        )
    return trees


@settings(max_examples=30, deadline=None)
@given(random_forest(), st.sampled_from(CASES), st.integers(0, 10))
def test_per_leaf_packed_equals_flattened_on_random_trees(trees, case, seed):
    name, agg, kind, eps = case
    b, logp = _shared_batch(trees, seed)
    p = b.packed
    assert torch.equal(path_token_index(p), p.flatten().packed_index)
    a = logp.clone().requires_grad_(True)
    out = compute_loss(a, b, _cfg(name, agg))
    out.loss.backward()
    g = logp.clone().requires_grad_(True)
    ref = _flattened(b, g, kind, eps)
    ref.backward()
    assert torch.allclose(out.loss, ref, atol=1e-5)
    assert torch.allclose(a.grad, g.grad, atol=1e-5)
