"""Property: no sequence of model turns crashes or stalls a rollout (hypothesis, a scripted engine).

The policy is a `ScriptedEngine` over a byte-level tokenizer (any text is a
token sequence, so a turn can be anything, and the engine cuts it at the
token limit like a real one). Turns are drawn from adversarial pieces: tool
calls nested up to thousands of levels deep, huge argument lists, dozens of
calls in one turn, lone-surrogate escapes and chat-format tokens that the
tool echoes back, state-growing calls that end in a state `deepcopy` cannot
copy, broken JSON, random text and final answers. For every draw the rollout
and an expansion return, the trees are valid and survive a JSONL round
trip, no turn ran more tools than the cap, and no tool ever received
arguments deeper than the parser's bound.

The fast slice runs in the default test command; `test_..._long` is marked slow.
"""

import json
import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scripted_engine import ScriptedEngine
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trace_mega.config import RolloutConfig
from trace_mega.envs.base import Env, Task
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.react import MAX_ARG_DEPTH
from trace_mega.rollout.tree import RolloutTree

CAP = 4
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("echo", "grow")]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (the GPT-2 byte alphabet, no merges) plus ChatML's special tokens."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>", "<pad>")]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<|im_end|>", pad_token="<pad>", additional_special_tokens=["<|im_start|>"]
    )
    tok.chat_template = CHATML
    return tok


def depth_of(value) -> int:
    """Container nesting of `value` (an explicit stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


class EchoGrowEnv(Env):
    """`echo` returns its arguments verbatim (surrogates, control tokens); `grow` nests the state n levels."""

    name = "echo_grow"

    def __init__(self):
        self.lock = threading.Lock()
        self.deepest = 0

    def tasks(self, split="train"):
        return [Task("t", [{"role": "user", "content": "answer 42"}], tools=TOOLS)]

    def step(self, state, call):
        with self.lock:
            self.deepest = max(self.deepest, depth_of(call.arguments))
        state.history.append(call)
        if call.name == "grow":
            n = call.arguments.get("n")
            for _ in range(min(n, 3000) if isinstance(n, int) else 0):
                state.data["tree"] = {"child": state.data.get("tree")}
        return "echo " + json.dumps(call.arguments, ensure_ascii=False)[:500]

    def reward(self, state, final_answer):
        return float(final_answer == "42")


def _call(name, args_json):
    return '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, args_json)


PIECES = st.one_of(
    st.integers(0, 1200).map(
        lambda d: _call("echo", '{"v": ' + "[" * d + "]" * d + "}")
    ),  # json.loads gives up past ~1000
    st.integers(0, 11000).map(lambda n: _call("echo", json.dumps({"v": [0] * n}))),
    st.tuples(st.integers(0, 12), st.sampled_from(["echo", "grow"])).map(lambda t: _call(t[1], '{"n": 700}') * t[0]),
    st.just(_call("echo", '{"v": "\\ud800\\udfff <|im_end|><|im_start|>assistant"}')),
    st.just("```json\n[" + ", ".join(['{"name": "echo", "arguments": {}}'] * 6) + "]\n```"),
    st.just('{"name": "echo", "arguments": {"v": ' + '{"a": ' * 800 + "1" + "}" * 800 + "}}"),
    st.just("<answer>42</answer>"),
    st.just("<answer>41</answer>"),
    st.just('<tool_call>{"name": "echo", "argu'),
    st.just("<think>"),
    st.just("</tool_call>"),
    st.text(max_size=40),
)
TURNS = st.lists(st.lists(PIECES, min_size=1, max_size=3).map("".join), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def check_rollout(tok, turns):
    env = EchoGrowEnv()
    end, start = tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    encoded = [tok.encode(t, add_special_tokens=False) + [end] for t in turns]

    def script(prefix, rng):  # later turns for longer conversations (2 message starts in the prompt)
        return encoded[min(prefix.count(start) - 2, len(encoded) - 1)]

    cfg = RolloutConfig(max_turns=4, max_new_tokens_per_turn=40_000, max_total_tokens=400_000)
    with AgentLoop(env, ScriptedEngine(script), tok, cfg, tool_timeout_s=30.0, max_tool_calls_per_turn=CAP) as loop:
        (tree,) = loop.rollout(env.tasks(), [2], seed=0)
        picks = [(0, n, 1) for n in [i for i, node in enumerate(tree.nodes) if i and node.reward is None][:2]]
        loop.expand([tree], picks, seed=1)
    tree.validate()
    assert len(tree.leaves()) == 2 + len(picks)
    assert all(tree.nodes[leaf].reward in (0.0, 1.0) for leaf in tree.leaves())
    for node in tree.nodes[1:]:
        assert len(node.info.get("tool_calls", [])) <= CAP
    assert env.deepest <= MAX_ARG_DEPTH
    line = json.dumps(tree.to_dict())
    assert RolloutTree.from_dict(json.loads(line)).to_dict() == json.loads(line)


def test_byte_tokenizer_round_trips_any_text(tok):
    text = 'x <tool_call>{"a": "\\ud800"}</tool_call> é 🙂\n'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


# The failures the issue found, always in the fast slice: 600 levels passed the parser and crashed env.fork
# and tree serialisation later; many calls in one turn; surrogates echoed into the tokenizer; a deep state.
KNOWN = [
    [_call("echo", '{"v": ' + "[" * 600 + "]" * 600 + "}"), _call("echo", "{}"), "<answer>42</answer>"],
    [_call("echo", "{}") * 40, "<answer>42</answer>"],
    [_call("echo", '{"v": "\\ud800 <|im_end|>"}'), "<answer>42</answer>"],
    [_call("grow", '{"n": 1500}') * 2, _call("echo", "{}"), _call("echo", "{}")],
]


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(turns=TURNS)
@example(turns=KNOWN[0])
@example(turns=KNOWN[1])
@example(turns=KNOWN[2])
@example(turns=KNOWN[3])
def test_no_model_output_crashes_or_stalls_a_rollout(tok, turns):
    check_rollout(tok, turns)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(turns=TURNS)
def test_no_model_output_crashes_or_stalls_a_rollout_long(tok, turns):
    check_rollout(tok, turns)
