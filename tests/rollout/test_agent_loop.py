"""The agent loop with a scripted engine and the synthetic environments."""

import threading

import pytest
from scripted_engine import ScriptedEngine, scripted_logprob

from trace_mega.config import RolloutConfig
from trace_mega.envs.synthetic import ANSWER_DONE, MOVE_LEFT, MOVE_RIGHT, REVEAL, SyntheticEnv, SyntheticToolsEnv
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.tree import load_jsonl, pack, save_jsonl


def tiny_policy(vocab: int, eos: int):
    """A random tiny Qwen3 over the synthetic envs' vocabulary (seeded: the same weights every call)."""
    import torch
    import transformers

    qcfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(qcfg).eval()


def open_nodes(tree):
    """Turn nodes that are not terminal: where continuations can branch."""
    return [i for i, n in enumerate(tree.nodes) if i and n.reward is None]


def cfg(**kw):
    base = dict(max_turns=6, max_new_tokens_per_turn=8, max_total_tokens=512)
    base.update(kw)
    return RolloutConfig(**base)


def walk_state(tok, prefix):
    """(goal, current cell) read from the prefix tokens: `start S goal G`, then the last `<tool_response> at X`."""
    toks = tok.convert_ids_to_tokens(prefix)
    goal = int(toks[len(toks) - 1 - toks[::-1].index("goal") + 1])  # the latest goal (multi-turn tasks move it)
    pos = int(toks[toks.index("start") + 1])
    for i in range(1, len(toks) - 1):
        if toks[i] == "at" and toks[i - 1] == "<tool_response>":
            pos = int(toks[i + 1])
    return goal, pos


def oracle(tok, thought=("at",)):
    """Walk towards the goal, then answer; emits a short thought before each action."""
    ids = {a: tok.convert_tokens_to_ids(a) for a in (MOVE_LEFT, MOVE_RIGHT, ANSWER_DONE)}
    pre = tok.convert_tokens_to_ids(list(thought))

    def script(prefix, rng):
        goal, pos = walk_state(tok, prefix)
        act = ANSWER_DONE if pos == goal else (MOVE_RIGHT if goal > pos else MOVE_LEFT)
        return pre + [ids[act]]

    return script


def random_walker(tok):
    acts = [tok.convert_tokens_to_ids(a) for a in (MOVE_LEFT, MOVE_RIGHT, ANSWER_DONE)]
    return lambda prefix, rng: [rng.choice(acts)]


def turns_done(tok, prefix):
    return tok.convert_ids_to_tokens(prefix).count("<tool_response>")


def icefree(env):
    return [t for t in env.tasks() if t.meta["slip"] == 0.0]


def test_bare_rollouts_batched_and_token_exact():
    env = SyntheticToolsEnv(seed=0)
    tok = env.tokenizer
    engine = ScriptedEngine(oracle(tok))
    loop = AgentLoop(env, engine, tok, cfg())
    tasks = icefree(env)[:4]
    dists = [abs(t.meta["goal"] - t.meta["start"]) for t in tasks]
    trees = loop.rollout(tasks, [2, 3, 0, 1], seed=7)
    assert [t.prompt_id for t in trees] == [t.task_id for t in tasks]
    assert [len(t.leaves()) for t in trees] == [2, 3, 0, 1]
    # every episode's first turn is in the engine's first step; then one request per turn, whatever
    # the grouping the scheduler's timing made
    assert [len(p) for p, _ in engine.calls][0] == 6
    assert sum(len(p) for p, _ in engine.calls) == sum(c * (d + 1) for d, c in zip(dists, [2, 3, 0, 1]))
    assert all(s.stop_token_ids == env.stop_token_ids for _, s in engine.calls)
    seen = {tuple(p) for prefixes, _ in engine.calls for p in prefixes}
    for tree, task, d in zip(trees, tasks, dists):
        for leaf in tree.leaves():
            path = tree.path(leaf)
            assert tree.nodes[leaf].reward == 1.0 and tree.nodes[leaf].kind == "final" and len(path) == d + 2
            assert [tree.nodes[n].kind for n in path[1:-1]] == ["tool"] * d
            for n in path[1:]:
                # every turn continued from exactly the token stream the engine was given
                before = tree.prefix_token_ids(tree.nodes[n].parent)
                assert tuple(before) in seen
                node = tree.nodes[n]
                g = node.info["num_generated"]
                assert node.loss_mask == [1] * g + [0] * (len(node.token_ids) - g)
                assert node.logprobs[:g] == [scripted_logprob(len(before), j) for j in range(g)]
                assert all(x == 0.0 for x in node.logprobs[g:])
            # the whole path equals the chat template's render of the conversation
            msgs = list(task.messages)
            for n in path[1:]:
                node = tree.nodes[n]
                msgs.append({"role": "assistant", "content": node.text})
                if node.observation:
                    msgs.append({"role": "tool", "content": node.observation})
            full = tok.apply_chat_template(
                msgs, tools=task.tools, add_generation_prompt=False, tokenize=True, return_dict=False
            )
            stream = tree.prefix_token_ids(leaf)
            assert stream == list(full)[: len(stream)]
    assert loop.last_stats.generated_tokens == sum(sum(n.loss_mask) for t in trees for n in t.nodes)
    assert loop.last_stats.episodes == 6 and loop.last_stats.successes == 6
    assert sum(t.meta.get("generated_tokens", 0) for t in trees) == loop.last_stats.generated_tokens
    assert trees[2].runtime["states"].keys() == {0}


def test_expand_restores_env_state_at_intermediate_nodes():
    env = SyntheticToolsEnv(seed=1)
    tok = env.tokenizer
    right = tok.convert_tokens_to_ids(MOVE_RIGHT)
    done = tok.convert_tokens_to_ids(ANSWER_DONE)
    # bare rollouts walk right 3 times then answer; continuations follow the oracle
    bare = lambda prefix, rng: [right] if turns_done(tok, prefix) < 3 else [done]  # noqa: E731
    engine = ScriptedEngine(bare)
    loop = AgentLoop(env, engine, tok, cfg())
    task = next(t for t in icefree(env) if t.meta["start"] == 1 and t.meta["goal"] == 2)
    (tree,) = loop.rollout([task], [1], seed=0)
    path = tree.path(tree.leaves()[0])
    assert tree.nodes[path[-1]].reward == 0.0  # overshot to cell 4
    assert [tree.nodes[n].observation for n in path[1:4]] == ["at 2", "at 3", "at 4"]
    assert open_nodes(tree) == path[1:4]
    stored = {n: dict(tree.runtime["states"][n].data) for n in path[:4]}
    engine.script = oracle(tok, thought=())
    n_calls = len(engine.calls)
    loop.expand([tree], [(0, path[3], 3), (0, path[1], 2)], seed=5)
    assert len(tree.leaves()) == 6
    # continuations from the node "at 4" walk left twice; from "at 2" they answer at once
    for leaf in tree.leaves()[1:]:
        p = tree.path(leaf)
        assert tree.nodes[leaf].reward == 1.0
        if p[:4] == path[:4]:
            assert [tree.nodes[n].observation for n in p[4:-1]] == ["at 3", "at 2"]
        else:
            assert p[:2] == path[:2] and len(p) == 3
    # all 5 continuations start together; then one request per turn: 3 x (left, left, answer) + 2 x answer
    assert len(engine.calls[n_calls][0]) == 5
    assert sum(len(x) for x, _ in engine.calls[n_calls:]) == 3 * 3 + 2
    # stored states were not mutated by the continuations
    assert {n: dict(tree.runtime["states"][n].data) for n in path[:4]}.keys() == stored.keys()
    assert all(tree.runtime["states"][n].data["pos"] == stored[n]["pos"] for n in stored)
    tree.validate()
    with pytest.raises(ValueError, match="terminal"):
        loop.expand([tree], [(0, path[-1], 1)])
    with pytest.raises(IndexError):
        loop.expand([tree], [(1, 0, 1)])


def test_expand_synthetic_continuations_are_independent_and_keep_prefix_value():
    env = SyntheticEnv(num_tasks=4, num_bits=4, seed=3)
    tok = env.tokenizer
    reveal, done = tok.convert_tokens_to_ids(REVEAL), tok.convert_tokens_to_ids(ANSWER_DONE)
    engine = ScriptedEngine(lambda prefix, rng: [reveal] if turns_done(tok, prefix) < 2 else [done])
    loop = AgentLoop(env, engine, tok, cfg())
    trees = loop.rollout(env.tasks(), [2] * 4, seed=0)
    for ti, tree in enumerate(trees):
        for n in open_nodes(tree):
            st = tree.runtime["states"][n]
            bits = [int(tree.nodes[m].observation.split()[1]) for m in tree.path(n)[1:]]
            lo = sum(b * 2.0 ** -(k + 1) for k, b in enumerate(bits))
            assert st.data["lo"] == pytest.approx(lo) and st.data["revealed"] == len(bits)
    for tree, task in zip(trees, env.tasks()):  # the same values from the recorded observations alone
        for n in open_nodes(tree):
            obs = [tree.nodes[m].observation for m in tree.path(n)[1:]]
            assert env.true_value_from_observations(task, obs) == env.true_value(tree.runtime["states"][n])
    first = open_nodes(trees[0])[0]
    loop.expand(trees, [(0, first, 24)], seed=1)
    new_leaves = trees[0].leaves()[2:]
    second_bits = {trees[0].nodes[trees[0].path(leaf)[2]].observation for leaf in new_leaves}
    assert second_bits == {"bit 0", "bit 1"}  # fresh randomness below the branch point
    assert all(trees[0].path(leaf)[1] == first for leaf in new_leaves)


def test_malformed_output_becomes_error_observation():
    env = SyntheticToolsEnv(seed=0)
    tok = env.tokenizer
    garbage = tok.convert_tokens_to_ids(["at", "3", "<|im_end|>"])
    reveal = tok.convert_tokens_to_ids(REVEAL)  # a tool this environment does not have
    seq = {0: garbage, 1: [reveal]}
    script = lambda prefix, rng: seq.get(turns_done(tok, prefix), oracle(tok)(prefix, rng))  # noqa: E731
    loop = AgentLoop(env, ScriptedEngine(script), tok, cfg())
    task = next(t for t in icefree(env) if t.meta["start"] == 0 and t.meta["goal"] == 1)
    (tree,) = loop.rollout([task], [1], seed=0)
    path = tree.path(tree.leaves()[0])
    n1, n2 = tree.nodes[path[1]], tree.nodes[path[2]]
    assert n1.kind == "error" and "no tool call or final answer" in n1.info["error"]
    assert n1.observation.startswith("Error: no tool call") and n2.kind == "error"
    assert "unknown tool 'reveal'" in n2.observation
    # the error is shown in the chat format; the generated <|im_end|> is not repeated
    obs = tok.convert_ids_to_tokens(n1.token_ids[n1.info["num_generated"] :])
    assert obs == [
        "<|im_start|>",
        "user",
        "<tool_response>",
        "error",
        "</tool_response>",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
    ]
    assert tree.runtime["states"][path[2]].data["pos"] == 0  # nothing executed
    assert tree.nodes[path[-1]].reward == 1.0 and len(path) == 5  # the episode went on and succeeded
    assert loop.last_stats.parse_errors == 2


class HangingEnv(SyntheticToolsEnv):
    """A walk whose first tool call blocks until released (a hung tool)."""

    def __init__(self):
        super().__init__(seed=0)
        self.release = threading.Event()
        self.calls = 0

    def step(self, state, call):
        self.calls += 1
        if self.calls == 1:
            self.release.wait(30)
            state.data["pos"] = 99  # a late write to the abandoned fork must not leak into the tree
        return super().step(state, call)


def test_hanging_tool_becomes_timeout_observation():
    env = HangingEnv()
    tok = env.tokenizer
    loop = AgentLoop(
        env, ScriptedEngine(oracle(tok, thought=())), tok, cfg(), tool_timeout_s=0.5, max_concurrent_tool_calls=2
    )
    task = next(t for t in icefree(env) if t.meta["start"] == 0 and t.meta["goal"] == 2)
    try:
        (tree,) = loop.rollout([task], [1], seed=0)
    finally:
        env.release.set()
    path = tree.path(tree.leaves()[0])
    first = tree.nodes[path[1]]
    assert first.info["tool_timeout"] and "timed out after 0.5 s" in first.observation
    assert tree.runtime["states"][path[1]].data["pos"] == 0  # the timed-out call had no effect
    assert tree.nodes[path[-1]].reward == 1.0  # retried and reached the goal
    assert [tree.nodes[n].observation for n in path[2:-1]] == ["at 1", "at 2"]
    assert loop.last_stats.tool_timeouts == 1
    env.release.set()
    loop.close()


def test_turn_and_token_limits():
    env = SyntheticToolsEnv(seed=0)
    tok = env.tokenizer
    left, right = tok.convert_tokens_to_ids(MOVE_LEFT), tok.convert_tokens_to_ids(MOVE_RIGHT)
    zigzag = lambda prefix, rng: [right if turns_done(tok, prefix) % 2 == 0 else left]  # noqa: E731
    task = next(t for t in icefree(env) if t.meta["start"] == 2 and t.meta["goal"] == 5)
    # max_turns: the last turn's call is not executed, the leaf gets reward(state, None) = 0
    loop = AgentLoop(env, ScriptedEngine(zigzag), tok, cfg(max_turns=3))
    (tree,) = loop.rollout([task], [2], seed=0)
    for leaf in tree.leaves():
        node = tree.nodes[leaf]
        assert tree.depth(leaf) == 3 and node.reward == 0.0 and node.info["truncated"] == "max_turns"
        assert node.token_ids == [right] and node.observation == ""
    assert loop.last_stats.truncated_episodes == 2
    # the turn limit counts from the root: a continuation from depth 2 gets one turn
    deep = tree.path(tree.leaves()[0])[2]
    loop.expand([tree], [(0, deep, 2)], seed=1)
    new = tree.leaves()[2:]
    assert len(new) == 2 and all(tree.nodes[n].parent == deep and tree.depth(n) == 3 for n in new)
    # max_total_tokens: no path ever exceeds it; the crossing observation is dropped
    prompt_len = len(loop.scaffold.prompt_ids(task))
    dropped = set()
    for budget in (prompt_len + 3, prompt_len + 11, prompt_len + 12, prompt_len + 25):
        loop = AgentLoop(env, ScriptedEngine(zigzag), tok, cfg(max_total_tokens=budget, max_turns=50))
        (tree,) = loop.rollout([task], [1], seed=0)
        (leaf,) = tree.leaves()
        assert len(tree.prefix_token_ids(leaf)) <= budget and tree.nodes[leaf].reward == 0.0
        assert tree.nodes[leaf].info["truncated"] == "max_total_tokens"
        dropped.add(tree.nodes[leaf].info.get("observation_dropped", False))
    assert dropped == {True, False}  # both ways a budget ends: before a turn, and at a crossing observation
    # a prompt that alone fills the budget: an empty leaf, no engine call
    engine = ScriptedEngine(zigzag)
    (tree,) = AgentLoop(env, engine, tok, cfg(max_total_tokens=prompt_len)).rollout([task], [1])
    assert engine.calls == [] and tree.nodes[tree.leaves()[0]].token_ids == []
    pack([tree])  # empty leaves pack fine


def test_generation_cut_at_max_new_tokens_is_an_error_turn():
    env = SyntheticToolsEnv(seed=0)
    tok = env.tokenizer
    words = tok.convert_tokens_to_ids(["at", "1", "at", "2", "at"])
    move = oracle(tok, thought=())
    script = lambda prefix, rng: words if turns_done(tok, prefix) == 0 else move(prefix, rng)  # noqa: E731
    loop = AgentLoop(env, ScriptedEngine(script), tok, cfg(max_new_tokens_per_turn=3))
    task = next(t for t in icefree(env) if t.meta["start"] == 0 and t.meta["goal"] == 1)
    (tree,) = loop.rollout([task], [1], seed=0)
    first = tree.nodes[tree.path(tree.leaves()[0])[1]]
    assert first.info["finish_reason"] == "length" and first.info["num_generated"] == 3
    assert "token limit" in first.info["error"] and first.kind == "error"
    assert tree.nodes[tree.leaves()[0]].reward == 1.0
    assert loop.last_stats.length_cut_turns == 1


def test_determinism_jsonl_and_packing_of_loop_trees(tmp_path):
    def run():
        env = SyntheticToolsEnv(seed=11)
        loop = AgentLoop(env, ScriptedEngine(random_walker(env.tokenizer)), env.tokenizer, cfg())
        trees = loop.rollout(env.tasks()[:6], [3] * 6, seed=2)
        picks = [(i, open_nodes(t)[0], 2) for i, t in enumerate(trees) if open_nodes(t)]
        loop.expand(trees, picks, seed=3)
        return trees

    def untimed(trees):  # tool latencies are wall-clock measurements; everything else must be identical
        out = [t.to_dict() for t in trees]
        for d in out:
            for n in d["nodes"]:
                n["info"].pop("tool_s", None)
        return out

    a, b = run(), run()
    assert untimed(a) == untimed(b)
    assert any(len(t.leaves()) > 3 for t in a)
    save_jsonl(a, tmp_path / "t.jsonl")
    back = load_jsonl(tmp_path / "t.jsonl")
    assert [t.to_dict() for t in back] == [t.to_dict() for t in a]
    p = pack(back)
    assert p.compression_ratio() > 1.0 and p.leaf_nodes.numel() == sum(len(t.leaves()) for t in a)
    env = SyntheticToolsEnv()
    with pytest.raises(ValueError, match="keeps no environment state"):
        AgentLoop(env, ScriptedEngine(lambda p, r: []), env.tokenizer, cfg()).expand(
            back, [(0, open_nodes(back[0])[0], 1)]
        )
    AgentLoop.release(a)
    with pytest.raises(ValueError, match="keeps no environment state"):
        AgentLoop(env, ScriptedEngine(lambda p, r: []), env.tokenizer, cfg()).expand(a, [(0, open_nodes(a[0])[0], 1)])


class _Broken(ScriptedEngine):
    def __init__(self):
        super().__init__(lambda p, r: [])

    def generate(self, prefixes, sampling):
        return []


def test_bad_arguments():
    env = SyntheticToolsEnv()
    with AgentLoop(env, ScriptedEngine(lambda p, r: []), env.tokenizer, cfg()) as loop:
        with pytest.raises(ValueError, match="counts"):
            loop.rollout(env.tasks()[:2], [1])
        with pytest.raises(ValueError, match="non-negative"):
            loop.rollout(env.tasks()[:1], [-1])
        # an engine that returns nothing for a prefix violates the contract: a clear error, not a hang
        with pytest.raises(RuntimeError, match="0 completions for 1 prefixes"):
            AgentLoop(env, _Broken(), env.tokenizer, cfg()).rollout(env.tasks()[:1], [1])
    with pytest.raises(ValueError, match="tool_timeout_s"):
        AgentLoop(env, ScriptedEngine(lambda p, r: []), env.tokenizer, cfg(), tool_timeout_s=0)


def test_real_torch_engine_end_to_end_logprobs_match_recompute():
    """The loop with the in-process torch engine on a tiny random Qwen3 over the tiny vocabulary.

    Re-scoring every finished path in one forward pass must reproduce the
    behaviour log-probs stored on its generated tokens: the path IS the token
    stream the engine continued from (observations appended, nothing re-encoded).
    """
    import torch

    from trace_mega.rollout.engines import TorchEngine

    env = SyntheticToolsEnv(seed=0)
    tok = env.tokenizer
    model = tiny_policy(len(tok), tok.eos_token_id)
    engine = TorchEngine(model)
    loop = AgentLoop(env, engine, tok, cfg(max_new_tokens_per_turn=4, max_turns=4, max_total_tokens=80))
    trees = loop.rollout(icefree(env)[:3], [3, 3, 3], seed=0)
    picks = [(i, n, 2) for i, t in enumerate(trees) for n in open_nodes(t)[:1]]
    assert picks, "random policy produced no intermediate node"
    loop.expand(trees, picks, seed=1)
    assert loop.stats.cached_prefix_tokens > 0  # turns and continuations reused the prefix KV
    checked = set()
    for ti, tree in enumerate(trees):
        tree.validate()
        for leaf in tree.leaves():
            ids = tree.prefix_token_ids(leaf)
            assert len(ids) <= 80
            mask = [m for n in tree.path(leaf) for m in tree.nodes[n].loss_mask]
            lps = [x for n in tree.path(leaf) for x in tree.nodes[n].logprobs]
            owner = [(n, j) for n in tree.path(leaf) for j in range(len(tree.nodes[n].token_ids))]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            for i in range(1, len(ids)):
                if mask[i]:
                    assert abs(float(ref[i - 1]) - lps[i]) < 1e-4
                    checked.add((ti, *owner[i]))
    assert len(checked) == loop.stats.generated_tokens  # every generated token, each once


def test_compression_ratio_agent_loop_batch():
    """8 prompts x 8 bare rollouts x 4 continuations each, 6-turn `synthetic` episodes, tiny vocabulary."""
    import random

    env = SyntheticEnv(num_tasks=8, num_bits=5, seed=0)
    tok = env.tokenizer
    reveal, done = tok.convert_tokens_to_ids(REVEAL), tok.convert_tokens_to_ids(ANSWER_DONE)
    engine = ScriptedEngine(lambda prefix, rng: [reveal] if turns_done(tok, prefix) < 5 else [done])
    loop = AgentLoop(env, engine, tok, cfg())
    trees = loop.rollout(env.tasks(), [8] * 8, seed=0)
    rng = random.Random(0)
    picks = []
    for ti, tree in enumerate(trees):
        for path in (tree.path(leaf) for leaf in tree.leaves()):
            assert len(path) == 7  # prompt + 6 turns
            picks += [(ti, rng.choice(path[1:6]), 1) for _ in range(4)]
    loop.expand(trees, picks, seed=1)
    p = pack(trees)
    assert p.leaf_nodes.numel() == 8 * 8 * 5
    print(
        f"\nagent-loop batch: {p.leaf_nodes.numel()} trajectories, packed {p.num_tokens} tokens, "
        f"flattened {p.flattened_num_tokens()} tokens, compression {p.compression_ratio():.2f}x"
    )
    assert p.compression_ratio() > 2.0


class TwoLegEnv(SyntheticToolsEnv):
    """A multi-turn walk: after the first answer the user asks for a second goal and reveals a new tool."""

    EXTRA = {"type": "function", "function": {"name": "reveal", "parameters": {"type": "object", "properties": {}}}}

    def next_turn(self, state, final_answer):
        if state.data.get("leg", 0) == 1:
            return None
        state.data["leg"] = 1
        state.data["first_ok"] = state.data["pos"] == state.task.meta["goal"]
        state.data["goal2"] = 0
        state.data["tools"] = list(state.task.tools) + [self.EXTRA]
        return [{"role": "user", "content": "goal 0"}]

    def reward(self, state, final_answer):
        return float(
            final_answer == "done"
            and state.data.get("first_ok", False)
            and state.data.get("leg") == 1
            and state.data["pos"] == state.data["goal2"]
        )


def test_multi_turn_task_next_user_turn_and_revealed_tools():
    env = TwoLegEnv()
    tok = env.tokenizer
    reveal = tok.convert_tokens_to_ids(REVEAL)
    walk = oracle(tok, thought=())
    state = {"revealed": False}

    def script(prefix, rng):  # after the second user turn, call the newly revealed tool once
        toks = tok.convert_ids_to_tokens(prefix)
        if toks.count("goal") == 2 and not state["revealed"]:
            state["revealed"] = True
            return [reveal]
        return walk(prefix, rng)

    loop = AgentLoop(env, ScriptedEngine(script), tok, cfg(max_turns=10))
    task = next(t for t in icefree(env) if t.meta["start"] == 1 and t.meta["goal"] == 2)
    (tree,) = loop.rollout([task], [1], seed=0)
    path = tree.path(tree.leaves()[0])
    kinds = [tree.nodes[n].kind for n in path[1:]]
    assert kinds == ["tool", "final", "tool", "tool", "tool", "final"]  # right, answer | reveal, left, left, answer
    mid = tree.nodes[path[2]]
    assert mid.reward is None and mid.info["next_turn"] and mid.observation == "goal 0"
    assert tok.convert_ids_to_tokens(mid.token_ids[mid.info["num_generated"] :]) == [
        "<|im_end|>",
        "<|im_start|>",
        "user",
        "goal",
        "0",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
    ]
    assert mid.loss_mask == [1] + [0] * 8
    # the revealed tool parses (validated against state.data["tools"]); the walk env then rejects it itself
    rev = tree.nodes[path[3]]
    assert rev.info["tool_calls"] == [{"name": "reveal", "arguments": {}}] and "error" not in rev.info
    assert tree.nodes[path[-1]].reward == 1.0
    # the whole path is the chat template's render of the two-turn conversation
    msgs = list(task.messages)
    for n in path[1:]:
        node = tree.nodes[n]
        msgs.append({"role": "assistant", "content": node.text})
        if node.observation:
            msgs.append({"role": "user" if node.info.get("next_turn") else "tool", "content": node.observation})
    full = tok.apply_chat_template(msgs, tools=task.tools, tokenize=True, return_dict=False)
    stream = tree.prefix_token_ids(path[-1])
    assert stream == list(full)[: len(stream)]
    # branching after the first answer continues the second user turn
    loop.expand([tree], [(0, path[2], 2)], seed=1)
    for leaf in tree.leaves()[1:]:
        assert tree.nodes[leaf].reward == 1.0 and tree.path(leaf)[:3] == path[:3]
    # a turn limit inside the second leg: truncated, reward(state, None)
    (short,) = AgentLoop(env, ScriptedEngine(walk), tok, cfg(max_turns=2)).rollout([task], [1])
    leaf = short.nodes[short.leaves()[0]]
    assert leaf.kind == "final" and leaf.info["truncated"] == "max_turns" and leaf.reward == 0.0
