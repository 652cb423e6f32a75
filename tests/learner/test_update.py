"""The step's policy update (`Learner.train_step`): mini-batches x epochs of whole trees, old log-probs
from the learner or the engine, rollout importance weights, and the on-policy special case.

One in-process Megatron learner (random tiny Qwen3-style model, TP = 1, gloo on CPU).
"""

import dataclasses

import pytest
import torch

from trace_mega.config import AdvantageConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trace_mega.learner.learner import Learner
from trace_mega.learner.models import output_weight
from trace_mega.learner.optim import build_optimizer, train_step
from trace_mega.objective.advantages import compute_advantages
from trace_mega.objective.losses import compute_loss, rollout_is_weights
from trace_mega.ops.balance import balanced_bins, contrast_bins
from trace_mega.ops.logprobs import packed_token_logprobs
from trace_mega.rollout.tree import Node, RolloutTree, pack

VOCAB = 61


def _trees(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = lambda k: torch.randint(1, VOCAB, (k,), generator=g).tolist()  # noqa: E731
    turn = lambda gen, obs: Node(0, tok(gen + obs), [1] * gen + [0] * obs, [-1.0] * gen + [0.0] * obs)  # noqa: E731
    out = []
    for i in range(n):
        t = RolloutTree(f"p{i}", tok(4 + i))
        a = t.add_node(0, turn(3 + i % 2, 2))
        t.add_path(a, [turn(2, 3), turn(4, 0)], 1.0)
        t.add_path(a, [turn(3, 0)], 0.0)
        t.add_path(0, [turn(2, 1), turn(1 + i, 0)], float(i % 2))
        out.append(t)
    return out


@pytest.fixture(scope="module")
def learner():
    from trace_mega.learner.parallel import destroy_parallel

    cfg = TrainConfig(
        model=ModelConfig(vocab_size=VOCAB),
        parallel=ParallelConfig(device="cpu"),
        optim=OptimConfig(lr=1e-2, clip_grad_norm=0.0),
    )
    ln = Learner(cfg)
    yield ln
    destroy_parallel()


def _configure(ln, **kw):
    """Point the learner at new optim / loss fields (a fresh optimiser, as a new run would have)."""
    optim = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(OptimConfig)}}
    loss = {k: v for k, v in kw.items() if k not in optim}
    ln.cfg = dataclasses.replace(
        ln.cfg, optim=dataclasses.replace(ln.cfg.optim, **optim), loss=dataclasses.replace(LossConfig(), **loss)
    )
    ln.optimizer, ln.scheduler = build_optimizer(ln.chunks, ln.cfg.optim, ln.cfg.parallel, ln.groups)


def _weights(ln):
    return [p.detach().clone() for p in ln.policy.parameters()]


def _restore(ln, ws):
    with torch.no_grad():
        for p, w in zip(ln.policy.parameters(), ws):
            p.copy_(w)


def _batch(trees):
    """(layout, tree advantages) of `trees`: what the trainer hands `Learner.train_step`."""
    packed = pack(trees)
    return packed, compute_advantages(packed, trees, AdvantageConfig(name="tree"))


def test_balanced_bins_are_whole_balanced_and_deterministic():
    sizes = [10, 3, 7, 7, 2, 9, 1]
    bins = balanced_bins(sizes, 3)
    assert sorted(i for b in bins for i in b) == list(range(7))  # every item in exactly one bin
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(sizes[i] for i in range(7))
    assert bins == balanced_bins(sizes, 3) == [[0, 4, 6], [1, 5], [2, 3]]
    assert balanced_bins(sizes, 1) == [list(range(7))]


def test_contrast_bins_share_the_contrasted_trees_and_round_their_count():
    sizes = [10, 3, 7, 7, 2, 9, 1, 4]
    contrasted = [True, False, True, True, False, True, True, False]  # 5 contrasted
    bins = contrast_bins(sizes, contrasted, per_bin=2, most=8)
    assert len(bins) == 3  # round(5 / 2) = 3 (halves round up)
    assert sorted(i for b in bins for i in b) == list(range(8))
    shares = [sum(contrasted[i] for i in b) for b in bins]
    assert max(shares) - min(shares) <= 1 and min(len(b) for b in bins) >= 8 // 3
    assert bins == contrast_bins(sizes, contrasted, per_bin=2, most=8)
    assert len(contrast_bins(sizes, contrasted, per_bin=4, most=8)) == 1  # round(1.25)
    assert len(contrast_bins(sizes, contrasted, per_bin=1, most=4)) == 4  # capped
    assert contrast_bins(sizes, [False] * 8, per_bin=2, most=8) == [list(range(8))]  # at least 1


def _flat(trees):
    """`trees` with every leaf's reward set to 1: all-equal groups, so no advantage anywhere."""
    for t in trees:
        for leaf in t.leaves():
            t.nodes[leaf].reward = 1.0
    return trees


def test_mini_batches_sized_by_contrast_take_one_step_per_share(learner):
    """`contrasted_trees_per_mini_batch`: the optimiser steps follow the contrasted trees, not all
    trees, and the uncontrasted ones still give the predictor their pre-update hidden states."""
    trees = _trees(5) + _flat(_trees(3, seed=1))
    packed, adv = _batch(trees)
    flat = adv.advantages[packed.tree_tokens([5, 6, 7])]
    assert bool((flat == 0).all()) and bool((adv.advantages[packed.tree_tokens(range(5))] != 0).any())
    try:
        for per, steps in ((2, 3), (5, 1), (1, 5)):
            _configure(learner, contrasted_trees_per_mini_batch=per, lr=1e-6)
            before = learner.hidden_states(packed)
            update = learner.train_step(packed, adv)
            assert update.metrics["loss/optimizer_steps"] == float(steps)
            assert update.trees == list(range(8))
            torch.testing.assert_close(update.hidden, before, rtol=0, atol=1e-5)
    finally:  # the module's learner is shared: later tests size their mini-batches as before
        _configure(learner, contrasted_trees_per_mini_batch=0)


def test_one_mini_batch_one_epoch_is_exactly_the_on_policy_step(learner):
    """The default update equals one optimiser step of the on-policy policy gradient (old = lp.detach())."""
    trees = _trees()
    w0 = _weights(learner)
    _configure(learner)
    m = learner.train_step(*_batch(trees)).metrics
    w1 = _weights(learner)
    assert m["loss/optimizer_steps"] == 1.0 and m["loss/clip_fraction"] == 0.0
    assert m["loss/ratio_max"] == 1.0 and m["loss/approx_kl"] == 0.0

    # The same step by hand: the megatron step over the same micro-batches with ratio 1 by construction.
    _restore(learner, w0)
    _configure(learner)
    packed, adv = _batch(trees)
    cfg = learner.cfg.loss

    def loss_fn(hidden, batch):
        lb = batch["loss"]
        mb = lb.packed
        lp = packed_token_logprobs(hidden[0, : mb.num_tokens], output_weight(learner.chunks[0]), mb)
        units = mb.loss_mask.float().sum()
        return compute_loss(lp, lb, cfg, old_logprobs=lp.detach()).loss * units, units, {}

    batches = []
    for _, lb, _ in learner._micro_batches(packed, adv, range(len(trees))):
        ids, pos, mask = learner._inputs(lb.packed)
        batches.append({"input_ids": ids, "position_ids": pos, "tree_mask": mask, "loss": lb})
    train_step(learner.chunks, learner.optimizer, learner.scheduler, batches, loss_fn, learner.groups, output="hidden")
    assert all(torch.equal(a, b) for a, b in zip(w1, _weights(learner)))
    assert any(not torch.equal(a, b) for a, b in zip(w0, w1))


def test_old_logprobs_forward_matches_the_training_forward_and_returns_hidden(learner):
    trees = _trees()
    packed, adv = _batch(trees)
    lp, hidden = learner.old_logprobs(packed, return_hidden=True)
    assert hidden.shape == (packed.num_tokens, learner.hidden_size)
    assert torch.equal(hidden, learner.hidden_states(packed))
    mask = packed.loss_mask & (packed.prev_index >= 0)
    assert bool((lp[mask] < 0).all()) and bool((lp[~mask] == 0).all())
    # Given to a 1-mini-batch, 2-epoch update, the first step's ratio is 1 to float noise.
    _configure(learner, epochs_per_step=2, lr=1e-6)
    m = learner.train_step(packed, adv, old_logprobs=lp).metrics
    assert m["loss/optimizer_steps"] == 2.0 and m["loss/ratio_max"] == pytest.approx(1.0, abs=1e-3)


def test_mini_batches_and_epochs_step_the_optimiser_and_clip(learner):
    trees = _trees(6)
    _configure(learner, mini_batches_per_step=3, epochs_per_step=2, lr=5e-2)
    packed, adv = _batch(trees)
    before = learner.hidden_states(packed)
    update = learner.train_step(packed, adv)
    m = update.metrics
    # The predictor's hidden states are those of the pre-update weights (the no-grad forward), not
    # of a later mini-batch's forward.
    assert update.trees == list(range(len(trees)))
    torch.testing.assert_close(update.hidden, before, rtol=0, atol=1e-6)
    assert not torch.allclose(learner.hidden_states(packed), before, atol=1e-4)
    assert m["loss/optimizer_steps"] == 6.0 and m["loss/skipped"] == 0.0
    # Later mini-batches and the second epoch are off-policy: the clip acts.
    assert m["loss/clip_fraction"] > 0.0 and m["loss/ratio_max"] > 1.2 and m["loss/approx_kl"] > 0.0
    assert 0.0 <= m["loss/clip_fraction"] <= 1.0


def _set_behaviour(trees, packed, lp):
    """Write per-token behaviour log-probs `lp` (T,) of `packed` into the trees' nodes."""
    for g, (ti, lid) in enumerate(packed.node_local):
        s, e = int(packed.node_start[g]), int(packed.node_end[g])
        node = trees[ti].nodes[lid]
        node.logprobs = [float(x) if mk else 0.0 for x, mk in zip(lp[s:e].tolist(), node.loss_mask)]


def test_behaviour_old_logprobs_and_rollout_importance_weights(learner):
    trees = _trees()
    packed, _ = _batch(trees)
    lp = learner.old_logprobs(packed)
    _set_behaviour(trees, packed, lp - 0.3)  # the engine was 0.3 nats less likely on every token
    _configure(learner, old_logprobs="behaviour", lr=1e-8)
    m = learner.train_step(*_batch(trees)).metrics
    assert m["loss/ratio_mean"] == pytest.approx(torch.exp(torch.tensor(0.3)).item(), rel=1e-3)
    assert m["loss/logprob_mismatch"] == pytest.approx(0.3, rel=1e-3)
    # token-level truncated IS with cap 1.2: every weight e^0.3 = 1.35 is capped
    _configure(learner, rollout_is="token", rollout_is_cap=1.2, lr=1e-8)
    m = learner.train_step(*_batch(trees)).metrics
    assert m["loss/rollout_is_mean"] == pytest.approx(1.2, rel=1e-4)
    assert m["loss/rollout_is_max"] == pytest.approx(1.2, rel=1e-4)
    assert m["loss/rollout_is_capped_fraction"] == pytest.approx(1.0)
    _configure(learner, rollout_is="token", rollout_is_cap=2.0, lr=1e-8)
    m = learner.train_step(*_batch(trees)).metrics
    assert m["loss/rollout_is_mean"] == pytest.approx(1.3499, rel=1e-3) and m["loss/rollout_is_capped_fraction"] == 0.0


def _chain_batch():
    t = RolloutTree("x", [1, 2])
    a = t.add_node(0, Node(0, [3, 4], [1, 1], [0.0, 0.0]))
    t.add_path(a, [Node(0, [5], [1], [0.0])], 1.0)
    t.add_path(a, [Node(0, [6, 7], [1, 1], [0.0, 0.0])], 0.0)
    p = pack([t])
    return compute_advantages(p, [t], AdvantageConfig(name="tree")).loss_batch(p)


def test_rollout_is_weights_token_and_sequence():
    batch = _chain_batch()
    p = batch.packed
    m = p.loss_mask
    d = torch.zeros(p.num_tokens)
    # shared node: log ratio 0.2 per token; leaf 1: +0.5; leaf 2: −0.1 per token
    leaf1, leaf2 = p.leaf_nodes.tolist()
    shared = int(p.node_parent[leaf1])
    for node, val in ((shared, 0.2), (leaf1, 0.5), (leaf2, -0.1)):
        d[int(p.node_start[node]) : int(p.node_end[node])] = val
    d = torch.where(m, d, 0.0)
    beh = torch.where(m, -1.0 - d, 0.0)
    old = torch.where(m, torch.full_like(d, -1.0), 0.0)
    w, met = rollout_is_weights(old, beh, batch, "token", cap=1.5)
    assert torch.allclose(w[m], torch.exp(d[m]).clamp(max=1.5))
    assert bool((w[~m] == 1).all())
    w, met = rollout_is_weights(old, beh, batch, "sequence", cap=10.0)
    w1, w2 = torch.exp(torch.tensor(0.4 + 0.5)), torch.exp(torch.tensor(0.4 - 0.2))  # Π over each path
    s1 = int(p.node_start[leaf1])
    assert w[s1].item() == pytest.approx(w1.item(), rel=1e-5)
    assert w[int(p.node_start[leaf2])].item() == pytest.approx(w2.item(), rel=1e-5)
    assert w[int(p.node_start[shared])].item() == pytest.approx(((w1 + w2) / 2).item(), rel=1e-5)
    w, met = rollout_is_weights(old, beh, batch, "sequence", cap=2.0)
    assert w[s1].item() == pytest.approx(2.0) and met["rollout_is_max"].item() == pytest.approx(2.0)
    # the weights multiply each token's surrogate
    lp = old.clone()
    base = compute_loss(lp, batch, LossConfig(), old_logprobs=old).loss
    twice = compute_loss(lp, batch, LossConfig(), old_logprobs=old, is_weights=torch.full_like(lp, 2.0)).loss
    assert torch.allclose(twice, 2 * base)


def test_policy_gradient_over_signal_scales_each_mini_batch_and_without_kl_updates_as_the_filtered_loss(learner):
    """`drop_uncontrasted_from: policy_gradient`: each micro-batch's advantages carry its mini-batch's loss
    tokens over the loss tokens of that mini-batch's trees with signal; with no KL or entropy term the step's
    gradient equals `drop_uncontrasted`'s (the trees without signal out of the whole loss). The gradients are
    compared by their norm: Adam's first step divides each element by its own magnitude, so the weights after
    it differ on elements whose gradient is at rounding level."""
    trees = _trees(n=4)
    _flat([trees[1], trees[3]])  # two trees without signal
    packed = pack(trees)
    scaled = compute_advantages(
        packed, trees, AdvantageConfig(name="tree", drop_uncontrasted=True, drop_uncontrasted_from="policy_gradient")
    )
    dropped = compute_advantages(packed, trees, AdvantageConfig(name="tree", drop_uncontrasted=True))
    kept = compute_advantages(packed, trees, AdvantageConfig(name="tree"))
    assert scaled.pg_over_signal and not dropped.pg_over_signal
    loss_tokens = [int(packed.loss_mask[packed.tree_tokens([i])].sum()) for i in range(4)]
    for ids in ([0, 1, 2], [1, 2, 3], [1, 3]):
        signal = sum(loss_tokens[i] for i in ids if i in (0, 2))
        want = sum(loss_tokens[i] for i in ids) / signal if signal else 1.0
        for _, lb, idx in learner._micro_batches(packed, scaled, ids):
            assert torch.allclose(lb.advantages, scaled.advantages[idx] * want)
    w0 = _weights(learner)
    norms = {}
    for name, adv in (("scaled", scaled), ("dropped", dropped), ("kept", kept)):
        _restore(learner, w0)
        _configure(learner, lr=1e-2, epochs_per_step=1, mini_batches_per_step=1, contrasted_trees_per_mini_batch=0)
        norms[name] = learner.train_step(packed, adv).metrics["loss/grad_norm"]
        assert any(not torch.equal(a, b) for a, b in zip(w0, _weights(learner)))
    assert norms["scaled"] == pytest.approx(norms["dropped"], rel=1e-5)
    # the whole batch's mean: the same gradient, diluted by the loss tokens of the trees with signal over all
    assert norms["kept"] == pytest.approx(
        norms["dropped"] * (loss_tokens[0] + loss_tokens[2]) / sum(loss_tokens), rel=1e-5
    )
    _restore(learner, w0)
