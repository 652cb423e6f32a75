"""The per-prompt outcome memory (`trace_mega/predictor/memory.py`): the Beta posterior it plans with,
its decay, its scores and its checkpoint round trip."""

import json

import pytest
import torch

from trace_mega.config import PredictorConfig
from trace_mega.configbase import ConfigError, load_config
from trace_mega.predictor import PromptMemory
from trace_mega.rollout.tree import Node, RolloutTree


def _tree(rewards):
    t = RolloutTree("t", [1, 2])
    for r in rewards:
        t.add_path(0, [Node(-1, [3], [1], [-0.1])], r)
    return t


def test_the_posterior_pools_a_prompts_own_decayed_outcomes_with_its_prediction():
    mem = PromptMemory(5, prior_rollouts=4.0, half_life_steps=10.0)
    v = torch.tensor([0.6, 0.6, 0.6], dtype=torch.float64)
    assert torch.equal(mem.pool([0, 1, 2], v, step=0), v)  # nothing remembered yet: the prediction
    mem.record([0, 1, 2], [_tree([1, 1, 1, 1]), _tree([]), _tree([0, 1, 0, 1])], step=0)
    post = mem.pool([0, 1, 2, 3], torch.full((4,), 0.6, dtype=torch.float64), step=10)  # one half-life later
    # prompt 0: (4 * 0.6 + 4 * 0.5) / (4 + 4 * 0.5); 1 got no rollouts and 3 was never drawn: the prediction.
    assert post.tolist() == pytest.approx([(2.4 + 2.0) / 6.0, 0.6, (2.4 + 1.0) / 6.0, 0.6])
    # A second visit adds to the decayed evidence.
    mem.record([0], [_tree([0, 0])], step=10)
    assert mem.pool([0], torch.tensor([0.6], dtype=torch.float64), step=10).item() == pytest.approx(
        (2.4 + 2.0) / (4 + 4)
    )


def test_an_allocator_that_reads_no_prediction_gets_it_unchanged_and_the_memory_still_learns():
    mem = PromptMemory(3, prior_rollouts=2.0, half_life_steps=50.0)
    mem.record([1], [_tree([1, 1])], step=0)
    v = torch.tensor([0.3], dtype=torch.float64)
    assert torch.equal(mem.pool([1], v, step=1, read=False), v)
    assert mem.pool([1], v, step=1).item() > 0.3
    off = PromptMemory(3, prior_rollouts=0.0, half_life_steps=50.0)
    off.record([1], [_tree([1, 1])], step=0)
    assert torch.equal(off.pool([1], v, step=1), v)


def test_scores_compare_the_posterior_with_the_prediction_on_the_served_prompts():
    mem = PromptMemory(4, prior_rollouts=1.0, half_life_steps=1e9)
    mem.record([0], [_tree([0, 0, 0, 0])], step=0)
    mem.pool([0, 1], torch.tensor([0.5, 0.5], dtype=torch.float64), step=1)
    mem.record([0, 1], [_tree([0, 0]), _tree([1, 1])], step=1)
    m = mem.metrics()
    # prompt 0's posterior (0.5 + 0) / 5 = 0.1 against its target 0; prompt 1 unknown, 0.5 against 1.
    assert m["memory/brier"] == pytest.approx((0.1**2 + 0.5**2) / 2)
    assert m["memory/brier_prediction"] == pytest.approx((0.5**2 + 0.5**2) / 2)
    assert m["memory/known_fraction"] == 0.5


def test_the_state_round_trips_through_json_and_refuses_another_task_set():
    mem = PromptMemory(6, prior_rollouts=4.0, half_life_steps=20.0)
    mem.record([4, 2], [_tree([1, 0]), _tree([1])], step=3)
    state = json.loads(json.dumps(mem.state_dict()))
    back = PromptMemory(6, prior_rollouts=4.0, half_life_steps=20.0)
    back.load_state_dict(state)
    v = torch.full((6,), 0.5, dtype=torch.float64)
    assert torch.equal(back.pool(range(6), v, step=9), mem.pool(range(6), v, step=9))
    with pytest.raises(ValueError, match="6 tasks"):
        PromptMemory(7, 4.0, 20.0).load_state_dict(state)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="memory_prior_rollouts"):
        load_config(PredictorConfig, {"memory_prior_rollouts": -1})
    with pytest.raises(ConfigError, match="memory_half_life_steps"):
        load_config(PredictorConfig, {"memory_half_life_steps": 0})
