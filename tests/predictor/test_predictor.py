import pytest
import torch

from trace_mega.config import PredictorConfig
from trace_mega.predictor import build_predictor, predictor_samples
from trace_mega.rollout.tree import Node, RolloutTree, pack


def _turn(tok):
    return Node(0, [tok], [1], [-1.0])


def _six_prompts(reward: float, first_token: int):
    """Six prompts starting with `first_token`, each with two one-step paths scoring `reward`."""
    trees = []
    for i in range(6):
        t = RolloutTree(f"p{i}", [first_token, 5])
        for _ in range(2):
            t.add_path(t.add_node(0, _turn(3)), [_turn(6)], reward)
        trees.append(t)
    return pack(trees)


def _trees(n=24, seed=0):
    """Tree i: prompt token 1 (easy) or 2 (hard); a turn token 3 ("good") makes success likely."""
    g = torch.Generator().manual_seed(seed)
    trees = []
    for i in range(n):
        easy = i % 2 == 0
        t = RolloutTree(f"p{i}", [5, 1 if easy else 2])
        for _ in range(4):
            good = bool(torch.rand((), generator=g) < (0.8 if easy else 0.2))
            mid = t.add_node(0, _turn(3 if good else 4))
            t.add_path(mid, [_turn(6)], float(torch.rand((), generator=g) < (0.9 if good else 0.1)))
        trees.append(t)
    return trees


def test_targets_are_descendant_means_and_mix_is_reweighted():
    t = RolloutTree("p", [1, 2])
    a = t.add_node(0, _turn(3))
    t.add_path(a, [_turn(4)], 1.0)
    t.add_path(a, [_turn(5)], 1.0)
    t.add_path(0, [_turn(6), _turn(7)], 0.0)
    t.add_path(a, [_turn(8)], 0.0)
    packed = pack([t])
    s = predictor_samples(packed)
    got = {packed.node_local[n][1]: v for n, v in zip(s.node.tolist(), s.target.tolist())}
    # root: 2 of 4 leaves succeed; node a: 2 of 3; the first turn of the failing path: 0.
    assert got.keys() == {0, a, 4}  # node 4: the first turn of the failing path (5 is its leaf)
    assert abs(got[0] - 0.5) < 1e-6 and abs(got[a] - 2 / 3) < 1e-6 and got[4] == 0.0
    assert s.is_root.tolist().count(True) == 1 and abs(s.prefix_fraction - 2 / 3) < 1e-6
    w = predictor_samples(packed, prefix_fraction=0.5).weight
    assert abs(float(w[s.is_root].sum()) - 1.5) < 1e-6 and abs(float(w[~s.is_root].sum()) - 1.5) < 1e-6


def test_small_model_learns_prompt_and_prefix_values():
    torch.manual_seed(0)
    cfg = PredictorConfig(backend="small_model", lr=1e-2, updates_per_step=1)
    pred = build_predictor(cfg, hidden_size=0, vocab_size=8)
    train, test = pack(_trees(seed=1)), pack(_trees(seed=2))
    s_train, s_test = predictor_samples(train), predictor_samples(test)
    before = pred.fit(test, s_test).metrics["predictor/brier"]
    for _ in range(60):
        pred.fit(train, s_train)
    after = pred.fit(test, s_test).metrics
    assert after["predictor/brier"] < 0.6 * before
    assert after["predictor/skill"] > 0.3  # beats the previous fit's constant on held-out trees
    v = pred.predict(test, s_test.node)
    assert ((v >= 0) & (v <= 1)).all()


def test_value_head_reads_policy_hidden_states():
    torch.manual_seed(0)
    packed = pack(_trees(seed=3))
    s = predictor_samples(packed)
    # A "policy" whose hidden state carries the success-relevant token in one channel.
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()  # (T, 8)
    pred = build_predictor(
        PredictorConfig(backend="value_head", lr=0.1, updates_per_step=50), hidden_size=8, vocab_size=8
    )
    assert torch.equal(pred.predict(packed, s.node, hidden), torch.full((s.node.numel(),), 0.5))  # zero head
    first = pred.fit(packed, s, hidden).metrics
    # Calibrated on the predictions made before the update: 0.5 everywhere.
    assert first["predictor/brier"] == pytest.approx(float(((0.5 - s.target) ** 2).mean()), abs=1e-7)
    assert abs(float(pred.predict(packed, s.node[:1], hidden)) - 0.5) > 1e-3  # it moved
    second = pred.fit(packed, s, hidden).metrics
    assert second["predictor/brier"] < first["predictor/brier"]


def test_a_fit_on_non_finite_hidden_states_updates_nothing():
    """NaN policy states (a broken forward) give a NaN loss: every update of the fit is skipped and
    counted, the weights and the optimiser's state stay as they were; the next finite fit trains."""
    packed = pack(_trees(seed=3))
    s = predictor_samples(packed)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    pred = build_predictor(
        PredictorConfig(backend="value_head", lr=0.1, updates_per_step=3), hidden_size=8, vocab_size=8
    )
    assert pred.fit(packed, s, hidden).metrics["predictor/skipped"] == 0
    before = [p.detach().clone() for p in pred.parameters()]
    moments = {k: v.clone() for k, v in pred.optimizer.state[pred.head.weight].items()}
    bad = pred.fit(packed, s, torch.full_like(hidden, float("nan"))).metrics
    assert bad["predictor/skipped"] == 3
    assert all(torch.equal(a, b) for a, b in zip(before, pred.parameters()))
    assert all(torch.equal(v, pred.optimizer.state[pred.head.weight][k]) for k, v in moments.items())
    assert pred.fit(packed, s, hidden).metrics["predictor/skipped"] == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, pred.parameters()))


def test_replay_batches_are_trained_on():
    """Fitting on failures alone pulls every prediction down; with a replayed batch of
    successes the replayed prompts' predictions stay higher."""

    def batch(reward, first_token):
        packed = _six_prompts(reward, first_token)
        return packed, predictor_samples(packed)

    (pa, sa), (pb, sb) = batch(1.0, 1), batch(0.0, 2)
    preds = {}
    for replay in (False, True):
        torch.manual_seed(0)
        pred = build_predictor(
            PredictorConfig(backend="small_model", lr=1e-2, updates_per_step=30), hidden_size=0, vocab_size=8
        )
        pred.fit(pb, sb, replay=[(pa, sa, None)] if replay else [])
        preds[replay] = float(pred.predict(pa, sa.node).mean())
    assert preds[True] > preds[False] + 0.2


@pytest.mark.slow
def test_anchored_zero_head_is_the_constant_and_decay_weights_replay():
    """anchor_at_mean: an untrained head predicts the previous fit's mean target exactly (skill 0);
    replay_decay weighs an older batch less."""
    packed = pack(_trees(seed=4))
    s = predictor_samples(packed)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    cfg = PredictorConfig(backend="value_head", lr=0.1, updates_per_step=0, anchor_at_mean=True)
    pred = build_predictor(cfg, hidden_size=8, vocab_size=8)
    pred.fit(packed, s, hidden)  # sets the anchor; no update
    v = pred.predict(packed, s.node, hidden)
    assert torch.allclose(v, torch.full_like(v, float(s.target.mean())), atol=1e-6)
    assert pred.fit(packed, s, hidden).metrics["predictor/skill"] == pytest.approx(0.0, abs=1e-6)

    old, new = _six_prompts(1.0, 1), _six_prompts(0.0, 1)  # same features, opposite targets: the weights decide
    means = {}
    for decay in (1.0, 0.25):
        pred = build_predictor(
            PredictorConfig(backend="value_head", lr=0.1, updates_per_step=200, replay_steps=2, replay_decay=decay),
            hidden_size=8,
            vocab_size=8,
        )
        h_old, h_new = (torch.nn.functional.one_hot(p.tokens, 8).float() for p in (old, new))
        s_new = predictor_samples(new)
        pred.fit(new, s_new, h_new, replay=[(old, predictor_samples(old), h_old)])
        means[decay] = float(pred.predict(new, s_new.node, h_new).mean())
    assert means[1.0] == pytest.approx(0.5, abs=0.05)  # equal weights: the fit sits between 0 and 1
    assert means[0.25] == pytest.approx(0.2, abs=0.05)  # old batch weighs 0.25: 0.25 / 1.25


# The plain value head, and a root head with its token bag. Not anchored: with `anchor_at_mean`
# some gradients are exactly 0 in exact arithmetic (the bias on the first fit, a token in every
# prompt), their float noise differs between a DP sum and a one-process sum, and Adam (eps 1e-8)
# turns either noise into a step of about lr (docs/allocation.md "Known limitations").
DP_CONFIGS = {"head": {}, "root head + token bag": dict(root_head=True, root_token_bag=True)}


def _dp_fits(packed, hidden, trees, group=None, config="head"):
    """Three value-head fits (a replay window of 2) on the trees `trees` of `packed`; the head's
    weights and each fit's metrics."""
    torch.manual_seed(0)
    pred = build_predictor(
        PredictorConfig(replay_steps=2, lr=5e-2, **DP_CONFIGS[config]), hidden_size=hidden.shape[1], vocab_size=8
    )
    samples = predictor_samples(packed)
    if len(trees) < packed.num_trees:
        samples, hidden, packed = samples.share(packed, trees), hidden[packed.tree_tokens(trees)], packed.select(trees)
    metrics, replay = [], []
    for _ in range(3):
        out = pred.fit(packed, samples, hidden, replay=replay, group=group).metrics
        metrics.append({k: v for k, v in out.items() if not k.startswith("_")})
        replay = [(packed, samples, hidden)]
    return torch.cat([p.detach().flatten() for p in pred.parameters()]), metrics


def _dp_worker(rank, port, out, config):
    import torch.distributed as dist

    from trace_mega.learner.parallel import destroy_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    packed = pack(_trees(12))
    hidden = torch.randn(packed.num_tokens, 8, generator=torch.Generator().manual_seed(1))
    weights, metrics = _dp_fits(packed, hidden, list(range(rank, 12, 2)), group=dist.group.WORLD, config=config)
    torch.save((weights, metrics), f"{out}/rank{rank}.pt")
    destroy_parallel()  # the product's exit path: barrier, destroy, collect (docs/operations.md "Clean exits")


@pytest.mark.parametrize("config", list(DP_CONFIGS))
def test_a_data_parallel_fit_on_shares_equals_the_one_process_fit(tmp_path, config):
    """Two gloo ranks, each fitting on half the trees (its hidden rows only) with the gradients
    summed over DP, take the updates and report the metrics of one process fitting on all trees."""
    import torch.multiprocessing as mp

    from trace_mega.learner.parallel import free_port

    mp.start_processes(_dp_worker, args=(free_port(), str(tmp_path), config), nprocs=2, join=True, start_method="spawn")
    packed = pack(_trees(12))
    hidden = torch.randn(packed.num_tokens, 8, generator=torch.Generator().manual_seed(1))
    weights, metrics = _dp_fits(packed, hidden, list(range(12)), config=config)
    assert any(m["predictor/skill"] == m["predictor/skill"] for m in metrics)  # measured, not NaN throughout
    assert any(m["predictor/root_skill"] == m["predictor/root_skill"] for m in metrics)
    for r in range(2):
        w, m = torch.load(tmp_path / f"rank{r}.pt")
        torch.testing.assert_close(w, weights, rtol=1e-5, atol=1e-6)
        for a, b in zip(m, metrics):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7, nan_ok=True), k


def _roots_unlike_prefixes():
    """Six prompts whose last token (3) is also the last token of their one prefix: the same
    feature, but the root's target is 0.5 (leaves 1 and 0) and the prefix's 0."""
    trees = []
    for i in range(6):
        t = RolloutTree(f"p{i}", [5, 3])
        t.add_path(0, [_turn(6)], 1.0)
        t.add_path(t.add_node(0, _turn(3)), [_turn(6)], 0.0)
        trees.append(t)
    return pack(trees)


@pytest.mark.slow
@pytest.mark.parametrize("anchor", [False, True])
def test_root_head_separates_roots_from_prefixes_on_shared_features(anchor):
    """root_head: the roots get their own head (and anchor), so a root state that looks like a
    prefix state is no longer read as the prefixes' value; a shared head can only average them."""
    packed = _roots_unlike_prefixes()
    s = predictor_samples(packed)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    assert s.is_root.sum() == 6 and (~s.is_root).sum() == 6
    errs = {}
    for root_head in (False, True):
        torch.manual_seed(0)
        pred = build_predictor(
            PredictorConfig(lr=0.1, updates_per_step=300, root_head=root_head, anchor_at_mean=anchor),
            hidden_size=8,
            vocab_size=8,
        )
        pred.fit(packed, s, hidden)
        errs[root_head] = float((pred.predict(packed, s.node, hidden) - s.target).abs().max())
    assert errs[False] > 0.2  # one head on one feature: both kinds near 0.25
    assert errs[True] < 0.02


def test_root_head_anchors_each_kind_at_its_own_mean():
    """An untrained root head with anchor_at_mean predicts the previous fit's mean root target at
    the roots and the mean prefix target at the prefixes; a config without the head keeps one anchor."""
    packed = pack(_trees(seed=5))
    s = predictor_samples(packed)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    pred = build_predictor(
        PredictorConfig(updates_per_step=0, root_head=True, anchor_at_mean=True), hidden_size=8, vocab_size=8
    )
    pred.fit(packed, s, hidden)
    v = pred.predict(packed, s.node, hidden)
    for kind in (s.is_root, ~s.is_root):
        assert torch.allclose(v[kind], torch.full_like(v[kind], float(s.target[kind].mean())), atol=1e-6)
    with pytest.raises(ValueError, match="root_head"):
        PredictorConfig(backend="small_model", root_head=True).validate()


def _prompts_differing_mid_prompt():
    """Eight prompts [5, w, 7] (w = 1: "wall", never solved; w = 2: solved half the time) with
    one-step paths: the last prompt token is the same, so a head on its state cannot tell them apart."""
    trees = []
    for i in range(8):
        walled = i % 2 == 0
        t = RolloutTree(f"p{i}", [5, 1 if walled else 2, 7])
        for reward in (0.0, 0.0) if walled else (1.0, 0.0):
            t.add_path(0, [_turn(6)], reward)
        trees.append(t)
    return pack(trees)


@pytest.mark.slow
def test_root_token_bag_reads_a_word_the_last_tokens_state_does_not_carry():
    packed = _prompts_differing_mid_prompt()
    s = predictor_samples(packed)
    assert bool(s.is_root.all()) and s.target.tolist() == [0.0, 0.5] * 4
    # the policy's state at the last prompt token: equal for every prompt (as for `wall` vs `ice 7`)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    errs = {}
    for bag in (False, True):
        torch.manual_seed(0)
        pred = build_predictor(
            PredictorConfig(lr=0.1, updates_per_step=300, root_head=True, root_token_bag=bag, anchor_at_mean=True),
            hidden_size=8,
            vocab_size=8,
        )
        untrained = pred.predict(packed, s.node, hidden)
        assert torch.allclose(untrained, torch.full_like(untrained, 0.5))  # the bag starts at zero: no effect
        pred.fit(packed, s, hidden)
        errs[bag] = float((pred.predict(packed, s.node, hidden) - s.target).abs().max())
    assert errs[False] > 0.2  # both kinds at their mean, 0.25
    assert errs[True] < 0.05
    # scoring prefixes alone (no root among the nodes, as for the prefix plan) leaves the bag out
    turns = torch.nonzero(packed.node_parent >= 0).flatten()
    assert pred.predict(packed, turns, hidden).shape == turns.shape
    # the bag's weights moved only on the prompts' tokens, and most on the word that decides
    w = pred.root_bag.table[:, 0].detach()
    assert w[6] == 0 and w[1] < -1.0 and w[1] < w[2]


def test_root_token_bag_is_a_root_head_option():
    with pytest.raises(ValueError, match="root_token_bag"):
        PredictorConfig(root_token_bag=True).validate()
    PredictorConfig(root_head=True, root_token_bag=True).validate()
    for name in ("root_bag_pair_buckets", "root_bag_hidden_size"):
        with pytest.raises(ValueError, match=name):
            PredictorConfig(root_head=True, **{name: 4}).validate()
        with pytest.raises(ValueError, match=name):
            PredictorConfig(root_head=True, root_token_bag=True, **{name: -1}).validate()


@pytest.mark.slow
@pytest.mark.parametrize(("pairs", "width", "learns"), [(0, 16, False), (64, 0, False), (64, 16, True)])
def test_token_bag_reads_an_order_and_an_interaction_only_with_pairs_and_a_hidden_layer(pairs, width, learns):
    """Prompts [5, a, 6, b, 7], a and b in 1..3, solved half the time when b = a + 1, never otherwise (as a
    goal's distance from the start decides a walk). Single tokens cannot tell (1, 2) from (2, 1), and a
    sum of per-pair logits is additive in a and b, which b = a + 1 is not: only pairs through a hidden
    layer fit it. The policy's state at the last token is the same for every prompt."""
    trees = []
    for a in (1, 2, 3):
        for b in (1, 2, 3):
            t = RolloutTree(f"p{a}{b}", [5, a, 6, b, 7])
            for reward in (1.0, 0.0) if b == a + 1 else (0.0, 0.0):
                t.add_path(0, [_turn(4)], reward)
            trees.append(t)
    packed = pack(trees)
    s = predictor_samples(packed)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    cfg = PredictorConfig(
        lr=0.1, updates_per_step=300, root_head=True, anchor_at_mean=True, root_token_bag=True,
        root_bag_pair_buckets=pairs, root_bag_hidden_size=width,
    )  # fmt: skip
    pred = build_predictor(cfg, hidden_size=8, vocab_size=8)
    untrained = pred.predict(packed, s.node, hidden)
    assert torch.allclose(untrained, torch.full_like(untrained, 0.5))  # the bag starts at exactly 0
    pred.fit(packed, s, hidden)
    err = float((pred.predict(packed, s.node, hidden) - s.target).abs().max())
    assert (err < 0.1) if learns else (err > 0.2), err


def test_token_bag_pairs_stay_inside_each_prompt():
    """The features of two packed prompts: each one's tokens, then its adjacent pairs, hashed as
    vocab + (a * vocab + b) % buckets; no pair spans two prompts."""
    from trace_mega.predictor.token_bag import PromptTokenBag

    packed = pack([RolloutTree("p0", [1, 2, 3]), RolloutTree("p1", [4, 5])])
    roots = torch.nonzero(packed.node_parent < 0).flatten()
    ids, offsets = PromptTokenBag(8, pair_buckets=64).features(packed, roots)
    assert offsets.tolist() == [0, 5]
    assert ids.tolist() == [1, 2, 3, 8 + 10, 8 + 19, 4, 5, 8 + 37]
    ids, offsets = PromptTokenBag(8).features(packed, roots)
    assert ids.tolist() == [1, 2, 3, 4, 5] and offsets.tolist() == [0, 3]


def test_root_skill_is_the_roots_held_out_brier_against_their_previous_mean():
    """`predictor/root_skill`: the roots alone, before the fit, against the previous fit's mean root
    target (NaN on the first fit); the pooled skill mixes in the prefixes."""
    packed = pack(_trees(seed=3))
    s = predictor_samples(packed)
    hidden = torch.nn.functional.one_hot(packed.tokens, 8).float()
    pred = build_predictor(
        PredictorConfig(lr=0.1, updates_per_step=50, root_head=True, anchor_at_mean=True), hidden_size=8, vocab_size=8
    )
    first = pred.fit(packed, s, hidden).metrics
    assert first["predictor/root_skill"] != first["predictor/root_skill"]  # no previous mean yet
    assert first["predictor/root_samples"] == int(s.is_root.sum()) == 24
    prior = float(pred.prior_root_mean)
    before = pred.predict(packed, s.node, hidden)[s.is_root]
    target = s.target[s.is_root]
    second = pred.fit(packed, s, hidden).metrics
    brier, constant = float(((before - target) ** 2).mean()), float(((prior - target) ** 2).mean())
    assert second["predictor/root_brier"] == pytest.approx(brier, rel=1e-5)
    assert second["predictor/root_brier_constant"] == pytest.approx(constant, rel=1e-5)
    assert second["predictor/root_skill"] == pytest.approx(1 - brier / constant, rel=1e-5)
    assert (
        second["predictor/root_skill"] > 0.2
    )  # easy (token 1) and hard (token 2) prompts: learnt (targets are means of 4)
