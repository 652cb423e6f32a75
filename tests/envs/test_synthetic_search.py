"""synthetic_search: the hidden store, observations, rewards, tokens, and the ground-truth turn labels."""

import random

import pytest

from trace_mega.config import RolloutConfig
from trace_mega.credit.probe import answer_token_ids
from trace_mega.envs import ENVS, build_env
from trace_mega.envs.base import ToolCall
from trace_mega.envs.synthetic_search import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ANSWER_TEMPLATE,
    KEYS,
    SyntheticSearchEnv,
    answer_text,
    lookup_token,
    make_store,
    useful_lookups,
)
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.engines.base import Completion, Engine
from trace_mega.rollout.react import ReactScaffold, parse_turn


class TurnScriptEngine(Engine):
    """Emits turn i of `turns` (token strings) after i tool observations in the prefix (a real `Engine`)."""

    def __init__(self, tok, turns):
        super().__init__()
        self.tok, self.turns = tok, [[tok.convert_tokens_to_ids(t) for t in turn] for turn in turns]

    def generate(self, prefixes, sampling):
        out = []
        for prefix in prefixes:
            seen = self.tok.convert_ids_to_tokens(prefix).count("<tool_response>")
            ids = self.turns[min(seen, len(self.turns) - 1)]
            out.append(Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop"))
        return out

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass


def _resolve(facts, key):
    hops = 0
    while "pointer" in facts[key]:
        key, hops = facts[key]["pointer"], hops + 1
        assert hops <= len(KEYS)
    return facts[key]["value"]


def test_registry_and_options():
    assert "synthetic_search" in ENVS.names()
    env = build_env("synthetic_search", num_tasks=5, num_test_tasks=3, hops=[2], seed=1)
    assert len(env.tasks()) == 5 and len(env.tasks("test")) == 3
    assert all(t.meta["hops"] == 2 for t in env.tasks())
    for bad, match in (
        ({"num_tasks": 0}, "num_tasks"),
        ({"hops": [0]}, "hops"),
        ({"hops": []}, "hops"),
        ({"pointer_prob": 2.0}, "pointer_prob"),
    ):
        with pytest.raises(ValueError, match=match):
            build_env("synthetic_search", **bad)
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")


def test_store_gold_only_behind_the_chain():
    rng = random.Random(0)
    hops_seen = set()
    for _ in range(500):
        s = make_store(rng, (1, 2, 3), pointer_prob=0.5)
        chain, facts, gold = s["chain"], s["facts"], s["gold"]
        hops_seen.add(len(chain))
        assert sorted(facts) == KEYS and len(set(chain)) == len(chain)
        for i, k in enumerate(chain[:-1]):
            assert facts[k] == {"pointer": chain[i + 1]}
        assert facts[chain[-1]] == {"value": gold}
        for k in KEYS:
            if k in chain:
                continue
            # irrelevant keys never hold the gold value nor point into the chain
            assert facts[k].get("value") != gold and facts[k].get("pointer") not in chain
            assert facts[k].get("pointer") != k
        assert _resolve(facts, chain[0]) == gold
    assert hops_seen == {1, 2, 3}


def test_splits_are_deterministic_and_disjoint_streams():
    a, b = SyntheticSearchEnv(num_tasks=20, seed=3), SyntheticSearchEnv(num_tasks=20, seed=3)
    assert [t.meta for t in a.tasks()] == [t.meta for t in b.tasks()]
    assert [t.meta for t in a.tasks()] != [t.meta for t in SyntheticSearchEnv(num_tasks=20, seed=4).tasks()]
    assert [t.meta for t in a.tasks()][:5] != [t.meta for t in a.tasks("test")][:5]


def test_observations_and_reward():
    env = SyntheticSearchEnv(num_tasks=50, hops=[3], seed=0)
    task = env.tasks()[0]
    k0, k1, k2 = task.meta["chain"]
    assert task.messages[1]["content"] == f"find {k0}"
    s = env.reset(task)
    assert env.step(s, ToolCall("lookup", {"key": k0})) == f"{k0} is same as {k1}"
    assert env.step(s, ToolCall("lookup", {"key": k1})) == f"{k1} is same as {k2}"
    assert env.step(s, ToolCall("lookup", {"key": k2})) == f"{k2} is {task.gold_answer}"
    assert env.step(s, ToolCall("lookup", {"key": "z"})).startswith("Error")
    assert env.reward(s, task.gold_answer) == 1.0 and env.reward(s, None) == 0.0
    assert env.reward(s, str((int(task.gold_answer) + 1) % 10)) == 0.0
    f = env.fork(s)
    env.step(f, ToolCall("lookup", {"key": k0}))
    assert len(f.history) == 4 and len(s.history) == 3  # forks are independent


def test_tokens_parse_and_probe_template():
    env = SyntheticSearchEnv(num_tasks=2)
    tok = env.tokenizer
    assert len(tok) <= 64
    scaffold = ReactScaffold(tok)
    for k in KEYS:
        ids = tok.encode(lookup_token(k), add_special_tokens=False)
        assert len(ids) == 1 and ids[0] in env.stop_token_ids
        assert parse_turn(tok.decode(ids), env.tools).tool_calls[0].arguments == {"key": k}
    ans = tok.encode(answer_text("7"), add_special_tokens=False)
    assert len(ans) == 3 and ans[-1] in scaffold.stop_token_ids and ans[0] not in scaffold.stop_token_ids
    assert parse_turn(scaffold.decode(ans), env.tools).final_answer == "7"
    # the probe scores exactly one token: the digit, as the policy would write it after `<answer>`
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    tmpl, gold = answer_token_ids(encode, ANSWER_TEMPLATE, "7")
    assert tok.convert_ids_to_tokens(tmpl) == [ANSWER_OPEN] and tok.convert_ids_to_tokens(gold) == ["7"]
    # the observation is in-vocabulary text (no [UNK]) and the prompt reveals only the target key
    obs = scaffold.observation_ids(ans[:1], ["a is same as b", "c is 7"])
    assert tok.unk_token_id not in obs
    prompt = scaffold.prompt_ids(env.tasks()[0])
    assert tok.unk_token_id not in prompt and tok.decode(prompt).split().count(env.tasks()[0].meta["chain"][0]) == 1
    assert ANSWER_CLOSE in tok.get_vocab()


def test_useful_lookups_by_hand():
    chain = ["c", "e"]
    assert useful_lookups(chain, [["a"], ["c"], ["c"], ["e"], []]) == [False, True, False, True, False]
    assert useful_lookups(chain, [["e"], ["c"]]) == [True, True]  # out of order still reveals chain facts
    assert useful_lookups(chain, [["a", "c"], ["e", "c"]]) == [True, True]


def test_turn_labels_on_agent_loop_trees():
    env = SyntheticSearchEnv(num_tasks=40, hops=[2], seed=5)
    task = env.tasks()[0]
    k0, k1 = task.meta["chain"]
    other = next(k for k in KEYS if k not in task.meta["chain"])
    tok = env.tokenizer
    turns = [
        [lookup_token(other)],
        [lookup_token(k0)],
        [lookup_token(k0)],
        ["7"],
        [lookup_token(k1)],
        [ANSWER_OPEN, task.gold_answer, ANSWER_CLOSE],
    ]
    cfg = RolloutConfig(max_turns=8, max_new_tokens_per_turn=3, max_total_tokens=512)
    with AgentLoop(env, TurnScriptEngine(tok, turns), tok, cfg) as loop:
        (tree,) = loop.rollout([task], [1])
        labels = env.turn_labels(tree)
        kinds = [n.kind for n in tree.nodes]
        assert kinds == ["prompt", "tool", "tool", "tool", "error", "tool", "final"]
        assert labels == [None, False, True, False, False, True, False]
        assert tree.nodes[-1].reward == 1.0
        # A continuation branched below the irrelevant lookup (node 1) replays the script from its 2nd turn;
        # its labels follow its own path: the k0 lookup is new there, its repeat is not.
        loop.expand([tree], [(0, 1, 1)])
        labels = env.turn_labels(tree)
        assert len(tree) == 12 and tree.nodes[7].parent == 1
        assert labels[7:] == [True, False, False, True, False]
        # turns whose call was never executed (cut by max_turns) reveal nothing
        short = RolloutConfig(max_turns=2, max_new_tokens_per_turn=3, max_total_tokens=512)
    with AgentLoop(env, TurnScriptEngine(tok, [[lookup_token(k0)], [lookup_token(k1)]]), tok, short) as loop:
        (tree,) = loop.rollout([task], [1])
        assert env.turn_labels(tree) == [None, True, False] and tree.nodes[2].info["truncated"] == "max_turns"
    with pytest.raises(ValueError, match="chain"):
        env.turn_labels(type(tree)("x", [1, 2]))
