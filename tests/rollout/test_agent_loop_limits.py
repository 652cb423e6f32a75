"""Model output cannot crash or stall a rollout: argument bounds, calls per turn, one time budget per turn,
states that cannot be copied, lone surrogates in tool output."""

import json
import threading
import time

from scripted_engine import ScriptedEngine

from trace_mega.config import RolloutConfig
from trace_mega.envs.base import Env, Task
from trace_mega.envs.tokenizer import build_tiny_tokenizer
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.react import MAX_ARG_DEPTH
from trace_mega.rollout.tree import load_jsonl, save_jsonl

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("echo", "nap", "grow")
]
ANSWER = "<answer>done</answer>"


def call(name, arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def nested(depth):
    value = 0
    for _ in range(depth - 1):  # the arguments object is level 1
        value = [value]
    return {"v": value}


class EchoEnv(Env):
    """`echo` returns its arguments (surrogates and all), `nap` sleeps `s` seconds (or until released),
    `grow` nests the state `n` levels deeper (a state built by the model that deepcopy cannot copy)."""

    name = "echo"

    def __init__(self):
        self.started = 0
        self.release = threading.Event()
        self.release.set()
        self.lock = threading.Lock()

    def tasks(self, split="train"):
        return [Task("t", [{"role": "user", "content": "go"}], tools=TOOLS)]

    def step(self, state, call):
        with self.lock:
            self.started += 1
        state.history.append(call)
        if call.name == "nap":
            time.sleep(call.arguments.get("s", 0))
            self.release.wait(30)
        if call.name == "grow":
            for _ in range(call.arguments["n"]):
                state.data["tree"] = {"child": state.data.get("tree")}
        return "echo " + json.dumps(call.arguments, ensure_ascii=False)

    def reward(self, state, final_answer):
        return float(final_answer == "done")


def loop_for(actions, env=None, **kw):
    """An agent loop whose policy emits `actions[i]` (one whole-token action each) at turn i, then answers."""
    tok = build_tiny_tokenizer(["go", "echo"], [*actions, ANSWER])
    ids = [tok.convert_tokens_to_ids(a) for a in [*actions, ANSWER]]

    def script(prefix, rng):
        turn = tok.convert_ids_to_tokens(prefix).count("<tool_response>")
        return [ids[min(turn, len(ids) - 1)]]

    env = env or EchoEnv()
    cfg = RolloutConfig(max_turns=kw.pop("max_turns", 6), max_new_tokens_per_turn=4, max_total_tokens=100_000)
    return AgentLoop(env, ScriptedEngine(script), tok, cfg, **kw), env


def first_turn(tree):
    return tree.nodes[tree.path(tree.leaves()[0])[1]]


def test_deep_arguments_are_an_error_observation_and_the_rollout_survives(tmp_path):
    """600 levels passed the parser and the schema before, then env.fork / to_dict raised RecursionError."""
    loop, env = loop_for([call("echo", nested(600))])
    (tree,) = loop.rollout(env.tasks(), [2])
    node = first_turn(tree)
    assert (
        node.kind == "error"
        and f"arguments of 'echo' are nested deeper than {MAX_ARG_DEPTH} levels" in node.observation
    )
    assert env.started == 0 and tree.nodes[tree.leaves()[0]].reward == 1.0
    # just inside the bound: executed; forks share the recorded call instead of copying its arguments
    loop, env = loop_for([call("echo", nested(MAX_ARG_DEPTH))])
    (tree,) = loop.rollout(env.tasks(), [1])
    assert first_turn(tree).kind == "tool" and env.started == 1
    state = tree.runtime["states"][tree.path(tree.leaves()[0])[1]]
    fork = env.fork(state)
    assert fork.history[0] is state.history[0] and fork.history is not state.history and fork.task is state.task
    save_jsonl([tree], tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl")[0].to_dict() == tree.to_dict()
    loop.expand([tree], [(0, tree.path(tree.leaves()[0])[1], 2)])
    tree.validate()


def test_tool_calls_per_turn_are_capped():
    nine = "".join(call("echo", {"i": i}) for i in range(9))
    loop, env = loop_for([nine], max_tool_calls_per_turn=8)
    (tree,) = loop.rollout(env.tasks(), [1])
    node = first_turn(tree)
    assert node.kind == "error" and "9 tool calls in one turn; at most 8 are allowed" in node.observation
    assert env.started == 0
    loop, env = loop_for([nine], max_tool_calls_per_turn=9)
    (tree,) = loop.rollout(env.tasks(), [1])
    assert first_turn(tree).kind == "tool" and env.started == 9


def test_a_turns_tool_calls_share_one_time_budget():
    """Four 0.3 s calls against a 0.8 s budget: the turn times out (it had 4 x 0.8 s before)."""
    loop, env = loop_for(["".join(call("nap", {"s": 0.3}) for _ in range(4))], tool_timeout_s=0.8)
    (tree,) = loop.rollout(env.tasks(), [1])
    node = first_turn(tree)
    assert node.info["tool_timeout"] and "timed out after 0.8 s (shared by this turn's tool calls)" in node.observation
    assert loop.last_stats.tool_timeouts == 1 and tree.nodes[tree.leaves()[0]].reward == 1.0


def test_calls_after_the_budget_never_start():
    env = EchoEnv()
    env.release.clear()  # the first call hangs until released
    loop, env = loop_for(["".join(call("nap", {}) for _ in range(3))], env=env, tool_timeout_s=0.3)
    (tree,) = loop.rollout(env.tasks(), [1])
    assert first_turn(tree).info["tool_timeout"] and env.started == 1
    env.release.set()  # the abandoned worker finishes its call and must start none of the other two
    time.sleep(0.3)
    assert env.started == 1
    loop.close()


def test_a_state_that_cannot_be_copied_costs_a_turn_not_the_rollout(tmp_path):
    """`grow` nests the state 2,000 levels deep: deepcopy raises RecursionError in env.fork."""
    loop, env = loop_for([call("grow", {"n": 2000}), call("echo", {})], max_turns=4)
    (tree,) = loop.rollout(env.tasks(), [2])
    for leaf in tree.leaves():
        second = tree.nodes[tree.path(leaf)[2]]
        assert second.kind == "error" and "could not be copied (RecursionError" in second.observation
    tree.validate()
    save_jsonl([tree], tmp_path / "t.jsonl")
    loop.expand([tree], [(0, tree.path(tree.leaves()[0])[1], 2)])  # branching from the deep state works too
    assert len(tree.leaves()) == 4


def test_lone_surrogates_in_tool_output_are_escaped():
    """A tool echoing the model's "\\ud800" made the tokenizer raise TypeError inside the rollout."""
    loop, env = loop_for(['<tool_call>{"name": "echo", "arguments": {"v": "\\ud800 <|im_end|>"}}</tool_call>'])
    (tree,) = loop.rollout(env.tasks(), [1])
    node = first_turn(tree)
    assert node.kind == "tool" and "\ud800" in node.observation  # the record keeps what the tool said
    assert loop.scaffold.defuse("a \ud800 b") == "a \\ud800 b"
