"""TRACE-C math (trace_mega/credit/turn_credit.py) on hand-computed trajectories and trees."""

import math

import pytest
import torch

from trace_mega.credit.turn_credit import (
    lookahead_returns,
    mix_turn_advantages,
    node_td_rewards,
    node_turn_credit,
    path_nodes,
    state_values,
    td_rewards,
    trajectory_turn_credit,
)
from trace_mega.rollout.tree import Node, RolloutTree, pack


def _tree(spec, prompt=(1, 2, 3)):
    """spec rows: (parent local id, n tokens, kind, reward or None)."""
    t = RolloutTree("t", list(prompt))
    for parent, n, kind, reward in spec:
        nid = t.add_node(parent, Node(parent, [5] * n, [1] * n, [0.0] * n, kind=kind))
        if reward is not None:
            t.nodes[nid].reward = float(reward)
    return t


ELL = torch.tensor([-2.0, -1.0, -0.5])  # probes at S_0, S_1, S_2; with eps = 1: d = [3, 2, 1.5]


def test_state_values_and_td_rewards_by_hand():
    V = state_values(ELL, 1.0)
    assert torch.allclose(V, torch.tensor([0.0, math.log(3 / 2), math.log(2.0)]))
    delta = td_rewards(ELL, 1.0)
    assert torch.allclose(delta, torch.tensor([math.log(3 / 2), math.log(4 / 3)]))
    # Telescoping: Σ δ_k = V(S_K) − V(S_0), so redundant turns cannot add credit.
    assert math.isclose(float(delta.sum()), float(V[-1] - V[0]), rel_tol=1e-6)


def test_epsilon_must_be_positive():
    with pytest.raises(ValueError, match="epsilon"):
        state_values(ELL, 0.0)


def test_lookahead_truncated_at_the_end():
    delta = torch.tensor([1.0, 2.0, 4.0])
    assert torch.equal(lookahead_returns(delta, 0.5, 1), delta)
    # h = 2: R_0 = 1 + .5*2, R_1 = 2 + .5*4, R_2 = 4 (truncated)
    assert torch.allclose(lookahead_returns(delta, 0.5, 2), torch.tensor([2.0, 4.0, 4.0]))
    # h = 5 > K: R_0 = 1 + .5*2 + .25*4 = 3, R_1 = 2 + 2 = 4, R_2 = 4
    assert torch.allclose(lookahead_returns(delta, 0.5, 5), torch.tensor([3.0, 4.0, 4.0]))


def test_trajectory_turn_credit_answer_turn_gets_zero():
    # 3 turns (tool, tool, answer) and 3 probes: K = 2, the answer turn has no boundary after it.
    R = trajectory_turn_credit(ELL, 3, epsilon=1.0, gamma=0.5, horizon=2)
    r0 = math.log(3 / 2) + 0.5 * math.log(4 / 3)
    assert torch.allclose(R, torch.tensor([r0, math.log(4 / 3), 0.0]))
    # cut off after a tool call: 2 turns, 3 probes: the last turn keeps its own delta
    R2 = trajectory_turn_credit(ELL, 2, epsilon=1.0, gamma=0.5, horizon=2)
    assert torch.allclose(R2, torch.tensor([r0, math.log(4 / 3)]))
    with pytest.raises(ValueError):
        trajectory_turn_credit(ELL, 1, epsilon=1.0, gamma=0.5, horizon=2)


def test_mixing_rules():
    R = torch.tensor([0.3, -0.2, 0.0])
    final = torch.tensor([False, False, True])
    a_out = torch.full((3,), 0.7)
    anchored = mix_turn_advantages(R, a_out, final, "anchored", beta=2.0)
    assert torch.allclose(anchored, torch.tensor([0.6, -0.4, 0.7]))
    broadcast = mix_turn_advantages(R, a_out, final, "broadcast", beta=2.0)
    assert torch.allclose(broadcast, torch.tensor([1.3, 0.3, 0.7]))
    with pytest.raises(ValueError, match="mixing"):
        mix_turn_advantages(R, a_out, final, "sum", beta=1.0)


def _branching():
    # root -> a (tool) -> {a1 (final, r=1), a2 (tool) -> a2x (final, r=0)}
    return _tree([(0, 2, "tool", None), (1, 2, "final", 1), (1, 3, "tool", None), (3, 2, "final", 0)])


def test_node_credit_on_a_branching_tree_by_hand():
    p = pack([_branching()])
    # pre-order: root 0, a 1, a1 2, a2 3, a2x 4
    ell = torch.tensor([-3.0, -2.0, float("nan"), -1.0, float("nan")])  # d = 4, 3, -, 2, -
    delta = node_td_rewards(p, ell, 1.0)
    assert torch.allclose(delta, torch.tensor([0.0, math.log(4 / 3), 0.0, math.log(3 / 2), 0.0]))
    R = node_turn_credit(p, ell, 1.0, gamma=0.5, horizon=2)
    # path a1: R(a) = log 4/3 ; path a2x: R(a) = log 4/3 + .5 log 3/2 -> mean over the two leaves
    ra = math.log(4 / 3) + 0.25 * math.log(3 / 2)
    assert torch.allclose(R, torch.tensor([0.0, ra, 0.0, math.log(3 / 2), 0.0]))
    assert torch.equal(path_nodes(p), torch.tensor([[0, 1, 2, -1], [0, 1, 3, 4]]))


def test_node_credit_equals_trajectory_credit_on_a_chain():
    t = _tree([(0, 2, "tool", None), (1, 2, "tool", None), (2, 1, "tool", None), (3, 2, "final", 1)])
    p = pack([t])
    ell = torch.tensor([-2.5, -2.0, -0.8, -1.1, float("nan")])
    R = node_turn_credit(p, ell, 0.1, gamma=0.9, horizon=3)
    expected = trajectory_turn_credit(ell[:4], 4, epsilon=0.1, gamma=0.9, horizon=3)
    assert torch.allclose(R[1:], expected, atol=1e-6)
    assert R[0] == 0.0


def test_probe_on_child_without_parent_probe_is_an_error():
    p = pack([_branching()])
    ell = torch.tensor([-3.0, float("nan"), float("nan"), -1.0, float("nan")])
    with pytest.raises(ValueError, match="parent"):
        node_td_rewards(p, ell, 1.0)
