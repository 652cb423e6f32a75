"""Advantage estimators (advantages.py) on hand-computed rollout trees."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_mega.config import AdvantageConfig, CreditConfig
from trace_mega.credit.turn_credit import node_turn_credit, trajectory_turn_credit
from trace_mega.objective.advantages import ADVANTAGES, compute_advantages, leaf_mean
from trace_mega.rollout.tree import Node, RolloutTree, pack


def _tree(spec, pid="t", prompt=(1, 2, 3)):
    """spec rows: (parent local id, n tokens, kind, reward or None[, observation])."""
    t = RolloutTree(pid, list(prompt))
    for parent, n, kind, reward, *obs in spec:
        node = Node(parent, [4] * n, [1] * n, [0.0] * n, kind=kind, observation=obs[0] if obs else "")
        nid = t.add_node(parent, node)
        if reward is not None:
            t.nodes[nid].reward = float(reward)
    return t


def _flat(rewards, pid="f"):
    return _tree([(0, 2, "final", r) for r in rewards], pid)


def _node_adv(name, trees, **cfg):
    p = pack(trees)
    return p, ADVANTAGES.get(name)(p, trees, AdvantageConfig(name=name, **cfg))


def _by_local(p, node_adv, tree_index=0):
    """{local id: A} of one tree."""
    return {lid: float(node_adv[g]) for g, (ti, lid) in enumerate(p.node_local) if ti == tree_index}


def test_registry_names():
    assert ADVANTAGES.names() == ["gigpo", "grpo", "rloo", "trace_credit", "tree"]
    with pytest.raises(KeyError, match="valid names"):
        ADVANTAGES.get("ppo")


@pytest.mark.parametrize("normalize_std", [False, True])
def test_tree_reduces_exactly_to_grpo_on_flat_trees(normalize_std):
    trees = [_flat([1, 0, 0, 1], "a"), _flat([1, 1, 0], "b"), _flat([0, 0], "c")]
    _, g = _node_adv("grpo", trees, normalize_std=normalize_std)
    _, t = _node_adv("tree", trees, normalize_std=normalize_std)
    assert torch.equal(g.advantages, t.advantages)
    assert torch.equal(g.token_weight, t.token_weight)


def test_rloo_is_the_leave_one_out_baseline():
    trees = [_flat([1, 0, 0, 1], "a"), _flat([1, 1, 0], "b"), _flat([1], "c")]
    p, a = _node_adv("rloo", trees)
    expect = []
    for rewards in ([1, 0, 0, 1], [1, 1, 0], [1]):
        G = len(rewards)
        expect += [r - (sum(rewards) - r) / (G - 1) if G > 1 else 0.0 for r in rewards]
    assert torch.allclose(a.node_advantage[p.leaf_nodes], torch.tensor(expect))
    # a shared node: the mean of its leaves' leave-one-out advantages
    t = _tree([(0, 2, "tool", None), (1, 2, "final", 1), (1, 2, "final", 0), (0, 2, "final", 0)])
    p, a = _node_adv("rloo", [t])
    by = _by_local(p, a.node_advantage)
    assert by[2] == pytest.approx(1 - 0 / 2) and by[3] == pytest.approx(0 - 1 / 2)
    assert by[1] == pytest.approx((by[2] + by[3]) / 2)
    with pytest.raises(ValueError, match="normalize_std"):
        _node_adv("rloo", trees, normalize_std=True)


def test_grpo_by_hand_with_and_without_std():
    trees = [_flat([1, 0, 0, 1], "a"), _flat([1, 1, 0], "b")]
    p, g = _node_adv("grpo", trees)
    leaf = g.node_advantage[p.leaf_nodes]
    assert torch.allclose(leaf, torch.tensor([0.5, -0.5, -0.5, 0.5, 1 / 3, 1 / 3, -2 / 3]))
    p, g = _node_adv("grpo", trees, normalize_std=True)
    s_a = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    s_b = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)
    expected = [0.5 / s_a, -0.5 / s_a, -0.5 / s_a, 0.5 / s_a, (1 / 3) / s_b, (1 / 3) / s_b, (-2 / 3) / s_b]
    assert torch.allclose(g.node_advantage[p.leaf_nodes], torch.tensor(expected), atol=1e-5)
    # all-equal group or a group of one: no contrast, zero advantage (no NaN)
    p, g = _node_adv("grpo", [_flat([1, 1]), _flat([0], "one")], normalize_std=True)
    assert torch.equal(g.advantages, torch.zeros(p.num_tokens))


def _tree_a():
    # root -> a, b ; a -> a1 (1), a2 (0) ; b (0)
    return _tree([(0, 2, "tool", None), (1, 2, "final", 1), (1, 2, "final", 0), (0, 3, "final", 0)])


def _tree_b():
    # root -> a, b, c ; a -> a1 (1), a2 (1), a3 (0) ; b -> b1 -> {b1x (0), b1y (1)} ; c (0)
    return _tree(
        [
            (0, 2, "tool", None),  # 1 a
            (1, 1, "final", 1),  # 2 a1
            (1, 1, "final", 1),  # 3 a2
            (1, 1, "final", 0),  # 4 a3
            (0, 2, "tool", None),  # 5 b
            (5, 2, "tool", None),  # 6 b1
            (6, 1, "final", 0),  # 7 b1x
            (6, 1, "final", 1),  # 8 b1y
            (0, 2, "final", 0),  # 9 c
        ]
    )


def test_tree_and_grpo_on_tree_a_by_hand():
    p, t = _node_adv("tree", [_tree_a()])
    # V(a) = .5, V(b) = 0, root baseline .25; at a baseline .5
    assert _by_local(p, t.node_advantage) == pytest.approx({0: 0, 1: 0.25, 2: 0.75, 3: -0.25, 4: -0.25})
    p, g = _node_adv("grpo", [_tree_a()])
    # leaves 1, 0, 0 around 1/3; node a: mean of its leaves' (2/3, -1/3)
    assert _by_local(p, g.node_advantage) == pytest.approx({0: 0, 1: 1 / 6, 2: 2 / 3, 3: -1 / 3, 4: -1 / 3})


def test_tree_on_tree_b_by_hand():
    p, t = _node_adv("tree", [_tree_b()])
    # root children V = (2/3, 1/2, 0), mean 7/18; b has a single child (no group); b1 baseline 1/2
    expected = {
        0: 0,
        1: 5 / 18,
        2: 11 / 18,
        3: 11 / 18,
        4: -7 / 18,
        5: 1 / 9,
        6: 1 / 9,
        7: -7 / 18,
        8: 11 / 18,
        9: -7 / 18,
    }
    assert _by_local(p, t.node_advantage) == pytest.approx(expected)
    p, t = _node_adv("tree", [_tree_b()], normalize_std=True)
    s_root = math.sqrt(((5 / 18) ** 2 + (2 / 18) ** 2 + (7 / 18) ** 2) / 2)
    s_a = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)
    s_b1 = math.sqrt(2 * 0.25)
    got = _by_local(p, t.node_advantage)
    assert got[2] == pytest.approx(5 / 18 / s_root + 1 / 3 / s_a, rel=1e-5)
    assert got[4] == pytest.approx(5 / 18 / s_root - 2 / 3 / s_a, rel=1e-5)
    assert got[6] == pytest.approx(1 / 9 / s_root, rel=1e-5)
    assert got[8] == pytest.approx(1 / 9 / s_root + 0.5 / s_b1, rel=1e-5)


def test_token_weights_once_and_per_leaf():
    p, once = _node_adv("tree", [_tree_b()])
    p, per_leaf = _node_adv("tree", [_tree_b()], shared_token_weight="per_leaf")
    assert torch.equal(once.token_weight, p.loss_mask.float())
    node_w = {0: 0, 1: 3, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 1, 8: 1, 9: 1}  # leaves below (prompt: not trained)
    expected = torch.tensor([node_w[p.node_local[g][1]] for g in p.token_node.tolist()], dtype=torch.float32)
    assert torch.equal(per_leaf.token_weight, expected)
    assert torch.equal(once.advantages, per_leaf.advantages)


@pytest.mark.parametrize("name", ["grpo", "tree"])
def test_drop_uncontrasted_leaves_the_trees_without_signal_out_of_the_mean(name):
    """A contrasted group beside an all-1 and an all-0 group: with drop_uncontrasted the two flat trees'
    tokens weigh 0 and the token-mean loss is the contrasted tree's alone, as if they were filtered out."""
    from trace_mega.objective.losses import aggregation_coefficients

    trees = [_flat([1, 0, 1, 0], "c"), _flat([1, 1, 1, 1], "s"), _flat([0, 0, 0, 0], "u")]
    p = pack(trees)
    kept = compute_advantages(p, trees, AdvantageConfig(name=name))
    dropped = compute_advantages(p, trees, AdvantageConfig(name=name, drop_uncontrasted=True))
    tree_of_token = p.node_tree[p.token_node]
    assert torch.equal(dropped.advantages, kept.advantages)
    assert torch.equal(dropped.token_weight, kept.token_weight * (tree_of_token == 0))
    alone = pack(trees[:1])
    coef = aggregation_coefficients(dropped.loss_batch(p), "token_mean")  # (T,)
    coef_alone = aggregation_coefficients(
        compute_advantages(alone, trees[:1], AdvantageConfig(name=name)).loss_batch(alone), "token_mean"
    )
    assert torch.allclose(coef[tree_of_token == 0], coef_alone) and not coef[tree_of_token > 0].any()
    kept_coef = aggregation_coefficients(kept.loss_batch(p), "token_mean")
    # three trees of equal size: the contrasted one's tokens count 3x what they do among all three
    assert float(coef[tree_of_token == 0].sum()) == pytest.approx(3 * float(kept_coef[tree_of_token == 0].sum()))


@pytest.mark.parametrize("agg", ["token_mean", "sequence_mean", "prompt_mean"])
def test_drop_from_the_policy_gradient_keeps_the_kl_over_every_tree(agg):
    """`drop_uncontrasted_from: policy_gradient`: the advantages times `signal_scale` give the policy term of
    `drop_uncontrasted` (its mean over the contrasted tree) and the KL term of the whole batch, in value and in
    every gradient, under each aggregation."""
    from trace_mega.config import LossConfig
    from trace_mega.objective.losses import compute_loss, signal_scale

    trees = [_flat([1, 0, 1, 0], "c"), _flat([1, 1, 1, 1], "s"), _flat([0, 0, 0, 0], "u")]
    p = pack(trees)
    scaled = compute_advantages(
        p, trees, AdvantageConfig(name="tree", drop_uncontrasted=True, drop_uncontrasted_from="policy_gradient")
    )
    dropped = compute_advantages(p, trees, AdvantageConfig(name="tree", drop_uncontrasted=True))
    kept = compute_advantages(p, trees, AdvantageConfig(name="tree"))
    assert scaled.pg_over_signal and torch.equal(scaled.token_weight, kept.token_weight)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(p.num_tokens, generator=g)
    ref = old - 0.3 * torch.rand(p.num_tokens, generator=g)
    x0 = old + 0.2 * torch.randn(p.num_tokens, generator=g)
    kl, no_kl = LossConfig(kl_coef=0.04, aggregation=agg), LossConfig(aggregation=agg)

    def loss(batch, cfg):
        x = x0.clone().requires_grad_(True)
        out = compute_loss(x, batch, cfg, old_logprobs=old, ref_logprobs=ref).loss
        out.backward()
        return out.detach(), x.grad

    whole = scaled.loss_batch(p)
    s = signal_scale(whole, agg)
    assert s > 1.0
    got = loss(dataclasses.replace(whole, advantages=whole.advantages * s), kl)
    pg = loss(dropped.loss_batch(p), no_kl)
    kl_all = [a - b for a, b in zip(loss(kept.loss_batch(p), kl), loss(kept.loss_batch(p), no_kl))]
    assert torch.allclose(got[0], pg[0] + kl_all[0], atol=1e-6)
    assert torch.allclose(got[1], pg[1] + kl_all[1], atol=1e-6)
    assert kl_all[1].abs().sum() > 0 and not torch.allclose(got[1], loss(dropped.loss_batch(p), kl)[1], atol=1e-6)


def test_drop_from_needs_drop_uncontrasted():
    from trace_mega.configbase import ConfigError

    with pytest.raises(ConfigError, match="drop_uncontrasted_from"):
        AdvantageConfig(drop_uncontrasted_from="policy_gradient").validate()


def test_packed_grpo_with_per_leaf_weights_equals_flattened_grpo():
    """Σ_t w_t A_t x_t on the packed stream == Σ_paths Σ_{t∈path} A_leaf x_t (any per-token x)."""
    trees = [_tree_b(), _tree_a()]
    p = pack(trees)
    out = compute_advantages(p, trees, AdvantageConfig(name="grpo", shared_token_weight="per_leaf"))
    x = torch.randn(p.num_tokens, generator=torch.Generator().manual_seed(0))
    packed_sum = (out.token_weight * out.advantages * x).sum()
    flat = p.flatten()
    leaf_adv = out.node_advantage[flat.leaf_node]  # (L,) each trajectory's own GRPO advantage
    xs = torch.where(flat.loss_mask, x[flat.packed_index.clamp(min=0)], 0.0)
    flat_sum = (leaf_adv[:, None] * xs).sum()
    assert torch.allclose(packed_sum, flat_sum, atol=1e-5)
    batch = out.loss_batch(p)  # the loss's input, the layout itself unchanged
    assert batch.packed is p and batch.advantages is out.advantages and batch.token_weight is out.token_weight
    half = p.tree_tokens([1])  # a micro-batch of tree 1: its tokens' slices
    sub = out.loss_batch(p.select([1]), half)
    assert torch.equal(sub.advantages, out.advantages[half]) and torch.equal(sub.token_weight, out.token_weight[half])


def test_leaf_mean():
    p = pack([_tree_b()])
    vals = torch.arange(1.0, 7.0)  # leaves a1 a2 a3 b1x b1y c
    got = _by_local(p, leaf_mean(p, vals))
    assert got == pytest.approx({0: 3.5, 1: 2.0, 2: 1, 3: 2, 4: 3, 5: 4.5, 6: 4.5, 7: 4, 8: 5, 9: 6})


def test_gigpo_anchor_states_by_hand():
    # root -> a (obs X) -> a1 (1); b (obs X) -> b1 (0); c (obs Y) -> c1 (1)
    t = _tree(
        [
            (0, 2, "tool", None, "X"),
            (1, 2, "final", 1),
            (0, 2, "tool", None, "X"),
            (3, 2, "final", 0),
            (0, 2, "tool", None, "Y"),
            (5, 2, "final", 1),
        ]
    )
    p, g = _node_adv("gigpo", [t], gigpo_gamma=0.5, gigpo_step_weight=1.0)
    # episode: 1/3, -2/3, 1/3; first turns (anchor: prompt) returns .5, 0, .5 -> 1/6, -1/3, 1/6;
    # a1 and b1 act from the same state X: returns 1, 0 -> +-1/2; c1 alone (state Y) -> 0.
    expected = {0: 0, 1: 0.5, 2: 5 / 6, 3: -1.0, 4: -7 / 6, 5: 0.5, 6: 1 / 3}
    assert _by_local(p, g.node_advantage) == pytest.approx(expected)
    p, g0 = _node_adv("gigpo", [t], gigpo_step_weight=0.0)
    _, e = _node_adv("grpo", [t])
    assert torch.allclose(g0.node_advantage, e.node_advantage)


def _credit_tree():
    # root -> a (tool) -> {a1 (final, 1), a2 (tool) -> a2x (final, 0)} ; root -> b (final, 0)
    t = _tree([(0, 2, "tool", None), (1, 2, "final", 1), (1, 3, "tool", None), (3, 2, "final", 0), (0, 2, "final", 0)])
    t.gold_answer = "x"
    return t


def test_trace_credit_composes_with_tree_by_hand():
    t = _credit_tree()
    p = pack([t])  # pre-order: root 0, a 1, a1 2, a2 3, a2x 4, b 5
    ell = torch.tensor([-3.0, -2.0, float("nan"), -1.0, float("nan"), float("nan")])  # eps 1: d = 4, 3, 2
    adv_cfg = AdvantageConfig(name="tree")
    tree_adv = ADVANTAGES.get("tree")(p, [t], adv_cfg).node_advantage
    # tree: V(a) = .5, V(b) = 0 -> e(a) = .25, e(b) = -.25; under a (a1: 1, a2: 0) +-.5
    assert tree_adv.tolist() == pytest.approx([0, 0.25, 0.75, -0.25, -0.25, -0.25])
    R = node_turn_credit(p, ell, 1.0, 0.5, 2)
    ra = math.log(4 / 3) + 0.25 * math.log(3 / 2)
    assert R.tolist() == pytest.approx([0, ra, 0, math.log(3 / 2), 0, 0])
    anchored = compute_advantages(
        p,
        [t],
        adv_cfg,
        CreditConfig(enabled=True, epsilon=1.0, gamma_td=0.5, lookahead_turns=2, beta=2.0, mixing="anchored"),
        ell,
    )
    # internal turns: beta * R only; leaves (final turns): beta * R + A_out
    assert anchored.node_advantage.tolist() == pytest.approx([0, 2 * ra, 0.75, 2 * math.log(3 / 2), -0.25, -0.25])
    broadcast = compute_advantages(
        p,
        [t],
        adv_cfg,
        CreditConfig(enabled=True, epsilon=1.0, gamma_td=0.5, lookahead_turns=2, mixing="broadcast"),
        ell,
    )
    assert broadcast.node_advantage.tolist() == pytest.approx(
        [0, 0.25 + ra, 0.75, -0.25 + math.log(3 / 2), -0.25, -0.25]
    )


def _flat_probe(p):
    """ℓ̄ equal at every boundary (all δ = 0): NaN where a node has no boundary (final answers)."""
    ids = torch.arange(p.num_nodes)
    is_leaf = p.node_exit == ids
    return torch.where(is_leaf, torch.tensor(float("nan")), torch.tensor(-2.0))


@pytest.mark.parametrize(
    "trees",
    [
        lambda: [_tree_b(), _tree_a()],
        lambda: [_flat([1, 0, 0, 1], "a"), _flat([1, 0])],
        lambda: [
            _tree(
                [
                    (0, 2, "tool", None),
                    (1, 2, "final", 1),
                    (0, 2, "tool", None),
                    (3, 2, "final", 0),
                    (0, 2, "tool", None),
                    (5, 2, "final", 0),
                ]
            )
        ],
    ],
    ids=["two-level trees", "flat groups", "flat multi-turn group"],
)
def test_a_plus_c_default_keeps_every_branch_contrast_and_a_flat_probe_changes_nothing(trees):
    trees = trees()
    p = pack(trees)
    ell = _flat_probe(p)
    cfg = AdvantageConfig(name="tree")
    off = ADVANTAGES.get("tree")(p, trees, cfg)
    on = compute_advantages(p, trees, cfg, CreditConfig(enabled=True, beta=1.0), ell)
    assert torch.equal(on.node_advantage, off.node_advantage) and torch.equal(on.advantages, off.advantages)
    # the paper's literal rule zeroes the internal turns' contrasts (why it is not the A+C default)
    lit = compute_advantages(p, trees, cfg, CreditConfig(enabled=True, mixing="anchored"), ell)
    internal = (p.node_parent >= 0) & (p.node_exit != torch.arange(p.num_nodes))
    assert bool((lit.node_advantage[internal] == 0).all())
    if bool(internal.any()):  # single-turn groups have no internal turn
        assert bool((off.node_advantage[internal] != 0).any())
    # grpo (flat GRPO group) composes the same way under broadcast; under auto it keeps the paper's rule
    g_off = ADVANTAGES.get("grpo")(p, trees, AdvantageConfig(name="grpo"))
    g_on = compute_advantages(
        p, trees, AdvantageConfig(name="grpo"), CreditConfig(enabled=True, mixing="broadcast"), ell
    )
    assert torch.equal(g_on.node_advantage, g_off.node_advantage)


def test_a_plus_c_adds_beta_times_turn_credit_to_the_tree_term():
    t = _credit_tree()
    p = pack([t])
    ell = torch.tensor([-3.0, -2.0, float("nan"), -1.0, float("nan"), float("nan")])
    tree_adv = ADVANTAGES.get("tree")(p, [t], AdvantageConfig(name="tree")).node_advantage
    R = node_turn_credit(p, ell, 1.0, 0.5, 2)
    out = compute_advantages(
        p,
        [t],
        AdvantageConfig(name="tree"),
        CreditConfig(enabled=True, epsilon=1.0, gamma_td=0.5, lookahead_turns=2, beta=0.5),
        ell,
    )
    assert torch.allclose(out.node_advantage, tree_adv + 0.5 * R)


def test_trace_credit_on_a_single_trajectory_matches_the_paper_formula():
    # two chains under one root (group of 2): tool, tool, answer / answer
    t = _tree([(0, 2, "tool", None), (1, 2, "tool", None), (2, 2, "final", 1), (0, 2, "final", 0)])
    p = pack([t])
    ell = torch.tensor([-2.0, -1.5, -0.4, float("nan"), float("nan")])
    cfg = CreditConfig(enabled=True, epsilon=0.1, gamma_td=0.9, lookahead_turns=2)
    out = compute_advantages(p, [t], AdvantageConfig(name="grpo"), cfg, ell)
    R = trajectory_turn_credit(ell[:3], 3, epsilon=0.1, gamma=0.9, horizon=2)
    a_out = 0.5  # GRPO of (1, 0)
    assert out.node_advantage[1:4].tolist() == pytest.approx([R[0].item(), R[1].item(), a_out])
    assert out.node_advantage[4].item() == pytest.approx(-0.5)  # a lone answer turn: A_out only


def test_trace_credit_configuration_errors():
    t = _credit_tree()
    p = pack([t])
    cfg = CreditConfig(enabled=True)
    with pytest.raises(ValueError, match="node_ell"):
        compute_advantages(p, [t], AdvantageConfig(name="tree"), cfg)
    with pytest.raises(ValueError, match="credit.enabled"):
        compute_advantages(p, [t], AdvantageConfig(name="trace_credit"), cfg, torch.zeros(p.num_nodes))
    with pytest.raises(ValueError, match="shape|N="):
        compute_advantages(p, [t], AdvantageConfig(name="tree"), cfg, torch.zeros(2))


# --- properties on random trees ----------------------------------------------------------------


@st.composite
def random_trees(draw, max_trees=3, max_nodes=9):
    trees = []
    for ti in range(draw(st.integers(1, max_trees))):
        n = draw(st.integers(1, max_nodes))
        parents = [draw(st.integers(0, i)) for i in range(n)]  # node i+1 hangs below an earlier node
        has_child = {p for p in parents}
        spec = []
        for i, p in enumerate(parents, start=1):
            leaf = i not in has_child
            spec.append(
                (
                    p,
                    draw(st.integers(1, 3)),
                    "final" if leaf else "tool",
                    float(draw(st.integers(0, 1))) if leaf else None,
                )
            )
        trees.append(_tree(spec, f"r{ti}"))
    return trees


@settings(max_examples=40, deadline=None)
@given(random_trees(), st.booleans())
def test_tree_branch_contrasts_sum_to_zero_at_every_branch_point(trees, normalize_std):
    p, t = _node_adv("tree", trees, normalize_std=normalize_std)
    A = t.node_advantage
    for b in range(p.num_nodes):
        kids = torch.nonzero(p.node_parent == b).squeeze(1)
        if kids.numel() >= 2:  # e(c) = A(c) - A(b) is a group-relative deviation: Σ_c e(c) = 0
            assert abs(float((A[kids] - (A[b] if p.node_parent[b] >= 0 else 0.0)).sum())) < 1e-4
        elif kids.numel() == 1 and p.node_parent[b] >= 0:
            assert float(A[kids[0]]) == float(A[b])  # no group below a single-child node


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=6), min_size=1, max_size=4), st.booleans())
def test_tree_equals_grpo_on_random_flat_trees(rewards, normalize_std):
    trees = [_flat(r, f"f{i}") for i, r in enumerate(rewards)]
    _, g = _node_adv("grpo", trees, normalize_std=normalize_std)
    _, t = _node_adv("tree", trees, normalize_std=normalize_std)
    assert torch.equal(g.advantages, t.advantages)


@settings(max_examples=40, deadline=None)
@given(random_trees())
def test_grpo_per_leaf_linear_term_equals_flattened_on_random_trees(trees):
    p = pack(trees)
    out = compute_advantages(p, trees, AdvantageConfig(name="grpo", shared_token_weight="per_leaf"))
    x = torch.linspace(-1, 1, p.num_tokens)
    f = p.flatten()
    xs = torch.where(f.loss_mask, x[f.packed_index.clamp(min=0)], 0.0)
    flat_sum = (out.node_advantage[f.leaf_node][:, None] * xs).sum()
    assert torch.allclose((out.token_weight * out.advantages * x).sum(), flat_sum, atol=1e-4)
