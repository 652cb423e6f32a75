"""The warm start: transcript policy, determinism, cache, and the checkpoint as a user loads it."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_mega.commands.pretrain import PretrainConfig, SearchTranscriptEngine, config_hash, resolve_in_context
from trace_mega.config import RolloutConfig, load_config
from trace_mega.envs.synthetic_search import SyntheticSearchEnv
from trace_mega.rollout.agent_loop import AgentLoop

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "steps=6",
    "episodes_per_step=4",
    "num_stores=16",
    "model.num_layers=1",
    "model.hidden_size=16",
    "model.ffn_hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.head_dim=8",
    "model.max_position_embeddings=256",
]


def test_resolve_in_context_by_hand():
    words = "find a <tool_response> a is same as c </tool_response> <tool_response> b is 4 </tool_response>".split()
    assert resolve_in_context(words, "a") is None and resolve_in_context(words, "b") == "4"
    words += "<tool_response> c is 7 </tool_response>".split()
    assert resolve_in_context(words, "a") == "7" and resolve_in_context(words, "c") == "7"
    cyc = "x a is same as b b is same as a".split()
    assert resolve_in_context(cyc, "a") is None  # a pointer cycle resolves nothing and terminates


def test_transcripts_answer_right_exactly_when_resolved():
    env = SyntheticSearchEnv(num_tasks=200, seed=11)
    cfg = PretrainConfig(answer_prob=0.25, mentioned_key_prob=0.8, max_turns=5)
    rc = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens_per_turn=3, max_total_tokens=4096)
    with AgentLoop(env, SearchTranscriptEngine(env.tokenizer, cfg), env.tokenizer, rc) as loop:
        trees = loop.rollout(env.tasks(), [1] * 200, seed=3)
    resolved_right = unresolved_right = unresolved = 0
    for t in trees:
        (leaf,) = t.leaves()
        node = t.nodes[leaf]
        assert node.kind == "final" and t.depth(leaf) <= cfg.max_turns  # the last allowed turn answers
        assert all(n.kind != "error" for n in t.nodes)  # the policy only writes well-formed turns
        words = env.tokenizer.decode(t.prefix_token_ids(node.parent), skip_special_tokens=True).split()
        if resolve_in_context(words, t.meta["chain"][0]) is not None:
            assert node.reward == 1.0  # reading: a resolved chain's value is copied
            resolved_right += 1
        else:
            unresolved += 1
            unresolved_right += node.reward == 1.0
    assert resolved_right >= 20 and unresolved >= 20
    assert unresolved_right / unresolved < 0.25  # unresolved answers are guesses (1/10 expected)
    # the same rollout call gives the same transcripts; another seed others
    with AgentLoop(env, SearchTranscriptEngine(env.tokenizer, cfg), env.tokenizer, rc) as loop:
        again = loop.rollout(env.tasks(), [1] * 200, seed=3)
        other = loop.rollout(env.tasks(), [1] * 200, seed=4)
    tokens = lambda ts: [[n.token_ids for n in t.nodes] for t in ts]  # noqa: E731  (info holds timings)
    assert tokens(again) == tokens(trees) and tokens(other) != tokens(trees)


def test_config_hash_ignores_only_the_cache_dir():
    a = load_config(PretrainConfig, {"steps": 5, "cache_dir": "/x"})
    assert config_hash(a) == config_hash(load_config(PretrainConfig, {"steps": 5, "cache_dir": "/y"}))
    assert config_hash(a) != config_hash(load_config(PretrainConfig, {"steps": 6}))
    assert config_hash(a) != config_hash(load_config(PretrainConfig, {"steps": 5, "model": {"num_layers": 3}}))
    recompute = load_config(PretrainConfig, {"steps": 5, "parallel": {"recompute_activations": True}})
    assert config_hash(a) != config_hash(recompute)


def test_config_hash_of_a_shipped_warm_start_is_stable():
    """A field added with a default that trains as before must not orphan the cached warm starts:
    the allocation demo's key as of CACHE_VERSION 2 (docs/results/allocation.md cites its directory)."""
    from trace_mega.config import load_yaml
    from trace_mega.resources import resolve_config

    assert config_hash(load_yaml(PretrainConfig, resolve_config("pretrain_levels"))) == "60bb2e63e0239452"


def _pretrain(cache: Path, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "trace_mega", "pretrain", *TINY, f"cache_dir={cache}", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1]), proc


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model-00001-of-00001.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow
def test_pretrain_is_deterministic_cached_and_loadable(tmp_path):
    a, _ = _pretrain(tmp_path / "a")
    b, _ = _pretrain(tmp_path / "b")
    assert a.name == b.name and _digest(a) == _digest(b)  # same config -> identical weights
    record = json.loads((a / "pretrain.json").read_text())
    assert record["nll_last10"] < record["nll_first"]  # it learned something in 6 steps
    mtime = (a / "pretrain.json").stat().st_mtime_ns
    again, proc = _pretrain(tmp_path / "a")
    assert again == a and (a / "pretrain.json").stat().st_mtime_ns == mtime and "cached" in proc.stderr
    c, _ = _pretrain(tmp_path / "a", "seed=1")
    assert c != a and _digest(c) != _digest(a)
    # A user's view: transformers loads the model and the tokenizer (same vocabulary as the environment).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    assert tok.get_vocab() == SyntheticSearchEnv(num_tasks=1).tokenizer.get_vocab()
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.vocab_size >= len(tok)


def _walk_rates(correct: float, answer: float, samples: int = 64) -> dict[tuple[float, int], float]:
    from trace_mega.commands.pretrain import WalkTranscriptEngine
    from trace_mega.config import EnvConfig
    from trace_mega.envs import build_env

    opts = dict(width=5, max_distance=2, slips=[0.0, 0.9], slip_in_prompt="level")
    env = build_env("synthetic_tools", **opts, seed=3)
    cfg = PretrainConfig(
        env=EnvConfig(name="synthetic_tools", options=opts),
        correct_action_prob=correct,
        answer_prob=answer,
        max_turns=6,
    )
    rc = RolloutConfig(max_turns=6, max_new_tokens_per_turn=3, max_total_tokens=256)
    with AgentLoop(env, WalkTranscriptEngine(env.tokenizer, cfg), env.tokenizer, rc) as loop:
        trees = loop.rollout(env.tasks(), [samples] * len(env.tasks()), seed=1)
    by: dict[tuple[float, int], list[float]] = {}
    for task, tree in zip(env.tasks(), trees):
        assert all(n.kind != "error" for n in tree.nodes)  # only well-formed turns
        assert all(tree.depth(leaf) <= 6 for leaf in tree.leaves())
        by.setdefault((task.meta["slip"], abs(task.meta["goal"] - task.meta["start"])), []).extend(
            tree.nodes[leaf].reward for leaf in tree.leaves()
        )
    return {k: sum(v) / len(v) for k, v in by.items()}


def test_the_walker_transcripts_spread_difficulty_and_its_competence_is_the_knob():
    rates = _walk_rates(0.7, 0.15)
    # Dry tasks mostly solved, the iciest nearly never: the difficulty spread RL of a real LLM starts from.
    assert rates[(0.0, 1)] > 0.75 and rates[(0.0, 2)] > 0.45
    assert rates[(0.9, 1)] < 0.45 and rates[(0.9, 2)] < 0.08
    assert rates[(0.0, 1)] > rates[(0.0, 2)] > rates[(0.9, 1)] > rates[(0.9, 2)]
    perfect = _walk_rates(1.0, 0.0, samples=4)
    assert perfect[(0.0, 1)] == perfect[(0.0, 2)] == 1.0  # always the right action: every dry task solved
    never = _walk_rates(0.0, 0.0, samples=4)
    assert max(never.values()) == 0.0  # always the wrong action: never on the goal when it answers


@pytest.mark.slow
def test_pretrain_on_the_walk_learns_the_transcripts(tmp_path):
    walk = [
        "env.name=synthetic_tools",
        "env.options={width: 5, max_distance: 2, slips: [0.0, 0.9], slip_in_prompt: level}",
        "steps=30",
        "episodes_per_step=8",
    ]
    a, _ = _pretrain(tmp_path, *walk)
    record = json.loads((a / "pretrain.json").read_text())
    assert record["nll_last10"] < 0.6 * record["nll_first"]  # 3.7 -> 1.9 for this 1-layer model in 30 steps
    from transformers import AutoTokenizer

    from trace_mega.envs.synthetic import tiny_tokenizer

    assert AutoTokenizer.from_pretrained(a).get_vocab() == tiny_tokenizer().get_vocab()
