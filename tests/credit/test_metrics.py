"""credit/auc: ROC-AUC (ties one half) and the per-class δ means, on hand-built cases and a hand tree."""

import itertools
import math

import pytest
import torch

from trace_mega.config import CreditConfig
from trace_mega.credit.metrics import credit_accuracy, env_credit_accuracy, node_labels, roc_auc
from trace_mega.envs.synthetic import SyntheticToolsEnv
from trace_mega.rollout.tree import Node, RolloutTree, pack


def _pairwise_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)) / (len(pos) * len(neg))


def test_auc_by_hand_with_ties():
    # positives 3, 1, 1 ; negatives 1, 0 -> pairs: (3>1) (3>0) (1=1: 1/2) (1>0) (1=1: 1/2) (1>0) = 5 / 6
    scores = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])
    labels = torch.tensor([True, True, True, False, False])
    assert roc_auc(scores, labels) == pytest.approx(5 / 6)
    assert roc_auc(torch.tensor([2.0, 2.0]), torch.tensor([True, False])) == 0.5  # all tied: chance
    assert roc_auc(torch.tensor([0.0, 1.0]), torch.tensor([True, False])) == 0.0  # perfectly wrong
    assert math.isnan(roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([True, True])))


def test_auc_matches_pairwise_definition_on_random_ties():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        s = torch.randint(0, 4, (30,), generator=g).float()  # many ties
        y = torch.rand(30, generator=g) < 0.4
        assert roc_auc(s, y) == pytest.approx(_pairwise_auc(s.tolist(), y.tolist()), abs=1e-12)


def _turn(kind, reward=None):
    return Node(0, [7, 8], [1, 0], [0.0, 0.0], kind=kind, reward=reward)


def test_credit_accuracy_on_a_hand_tree():
    # root -> a (useful) -> {b (not) -> final r=1, c (useful) -> final r=0}; pre-order: 0 a b bf c cf
    t = RolloutTree("t", [1, 2], gold_answer="7")
    a = t.add_node(0, _turn("tool"))
    b = t.add_node(a, _turn("tool"))
    t.add_path(b, [_turn("final")], 1.0)
    c = t.add_node(a, _turn("tool"))
    t.add_path(c, [_turn("final")], 0.0)
    packed = pack([t])
    labels = [[None, True, False, False, True, False]]  # local ids: 0 root, 1 a, 2 b, 3 bf, 4 c, 5 cf
    assert node_labels(packed, labels).tolist() == [-1, 1, 0, 0, 1, 0]
    # eps = 1: d = 3 (root), 2 (a), 2.5 (b), 1 (c); finals have no boundary (NaN)
    nan = float("nan")
    ell = torch.tensor([-2.0, -1.0, -1.5, nan, 0.0, nan])
    cfg = CreditConfig(epsilon=1.0, lookahead_turns=1)
    m = credit_accuracy(packed, [t], ell, labels, cfg)
    d_a, d_b, d_c = math.log(3 / 2), math.log(2 / 2.5), math.log(2 / 1)
    assert m["credit/useful_turns"] == 2 and m["credit/other_turns"] == 1  # finals are not scored
    assert m["credit/delta_useful"] == pytest.approx((d_a + d_c) / 2)
    assert m["credit/delta_other"] == pytest.approx(d_b)
    assert m["credit/auc"] == 1.0 and m["credit/auc_R"] == 1.0
    # with look-ahead, R(b) = δ_b and R(a) = δ_a + γ mean(δ_b, δ_c): still above R(b)
    m2 = credit_accuracy(packed, [t], ell, labels, CreditConfig(epsilon=1.0, lookahead_turns=2, gamma_td=1.0))
    assert m2["credit/auc"] == 1.0 and m2["credit/auc_R"] == 1.0
    flipped = [[None, False, True, False, False, False]]  # b "useful" only: the lowest δ
    assert credit_accuracy(packed, [t], ell, flipped, cfg)["credit/auc"] == 0.0
    with pytest.raises(ValueError, match="one entry per node"):
        credit_accuracy(packed, [t], ell, [[None, True]], cfg)


def test_env_hook_only_when_probed_and_labelled():
    t = RolloutTree("t", [1, 2], gold_answer="7")
    t.add_path(0, [_turn("final")], 1.0)
    packed = pack([t])
    ell = torch.tensor([-1.0, float("nan")])
    assert env_credit_accuracy(SyntheticToolsEnv(), packed, [t], ell, CreditConfig()) == {}  # no labels
    assert env_credit_accuracy(SyntheticToolsEnv(), packed, [t], None, CreditConfig()) == {}  # credit off
