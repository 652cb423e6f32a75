"""Gold answers longer than `credit.max_answer_tokens` are refused (config, trainer start, probe), not scored."""

import pytest

from trace_mega.config import ConfigError, CreditConfig, TrainConfig, load_config
from trace_mega.credit.probe import check_task_answers, reference_probe
from trace_mega.envs.base import Task
from trace_mega.rollout.tree import Node, RolloutTree


def tokenize(s):
    return [ord(c) % 50 for c in s]  # one token per character


def _never_called(*_):
    raise AssertionError("the model must not run on a refused answer")


def test_config_field_and_validation():
    assert CreditConfig().max_answer_tokens == 32
    assert load_config(TrainConfig, {"credit": {"max_answer_tokens": 4}}).credit.max_answer_tokens == 4
    with pytest.raises(ConfigError, match="max_answer_tokens"):
        load_config(TrainConfig, {"credit": {"max_answer_tokens": 0}})


def test_probe_refuses_a_long_gold_answer_with_a_clear_message():
    tree = RolloutTree("q7", [1, 2, 3], gold_answer="a long and open answer")
    tree.add_path(0, [Node(0, [4, 5], [1, 1], [0.0, 0.0], kind="final")], 1.0)
    with pytest.raises(
        ValueError,
        match=r"tree 'q7': gold answer 'a long and open answer' is 22 tokens, more than "
        r"credit.max_answer_tokens = 8",
    ):
        reference_probe(_never_called, [tree], tokenize, "=", max_answer_tokens=8)


def test_task_answers_checked_before_training():
    ok = Task("t0", [], gold_answer="Paris")
    check_task_answers([ok], tokenize, "=", 5)
    with pytest.raises(ValueError, match=r"task 't1'.* 6 tokens, more than credit.max_answer_tokens = 5"):
        check_task_answers([ok, Task("t1", [], gold_answer="London")], tokenize, "=", 5)
    with pytest.raises(ValueError, match="no gold_answer"):
        check_task_answers([Task("t2", [])], tokenize, "=", 5)
    check_task_answers([Task("t1", [], gold_answer="London")], tokenize, "=", None)  # None: no limit
