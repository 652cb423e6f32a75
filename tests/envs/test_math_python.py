"""math_python: loaders, math-verify reward, the python tool, concurrent episodes."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from whole_token_engine import WholeTokenEngine

from trace_mega.envs import build_env
from trace_mega.envs.base import ToolCall
from trace_mega.envs.math_python import (
    MathPythonEnv,
    last_boxed,
    load_math,
    math_reward,
)
from trace_mega.envs.sandbox import SandboxLimits


@pytest.fixture(scope="module")
def env():
    e = build_env("math_python", limits=SandboxLimits(cpu_s=2, wall_s=30.0), max_workers=4)
    yield e
    e.close()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_shipped_problems(env):
    tasks = env.tasks("train")
    assert len(tasks) == 10 and env.tasks("test")[0].gold_answer == tasks[0].gold_answer
    for t in tasks:
        assert t.messages[0]["role"] == "system" and "<answer>" in t.messages[0]["content"]
        assert t.tools[0]["function"]["name"] == "python" and t.gold_answer
        assert math_reward(t.gold_answer, t.gold_answer) == 1.0
    with pytest.raises(ValueError):
        env.tasks("validation")


def test_deepscaler_and_math_layouts(tmp_path):
    deep = _write(
        tmp_path / "deepscaler.jsonl",
        [
            {"problem": "What is 2+3?", "answer": "5", "solution": "2+3=5"},
            {"problem": "Half of 1?", "answer": "\\frac{1}{2}", "solution": "..."},
        ],
    )
    math = _write(
        tmp_path / "math.jsonl",
        [
            {
                "problem": "Compute $\\sqrt{16}$.",
                "solution": "It is $\\boxed{4}$.",
                "level": "Level 1",
                "type": "Algebra",
            },
            {"problem": "Simplify.", "solution": "First $\\boxed{1}$, finally $\\boxed{\\frac{a}{b^{2}}}$."},
            {"problem": "MATH500 row", "solution": "x", "answer": "7", "unique_id": "test/algebra/1.json"},
        ],
    )
    d = load_math(deep)
    assert [t.gold_answer for t in d] == ["5", "\\frac{1}{2}"]
    assert d[0].messages[-1] == {"role": "user", "content": "What is 2+3?"}
    m = load_math(math)
    assert [t.gold_answer for t in m] == ["4", "\\frac{a}{b^{2}}", "7"]
    assert m[0].meta["level"] == "Level 1" and m[2].task_id == "test/algebra/1.json"
    bad = _write(tmp_path / "bad.jsonl", [{"problem": "no answer", "solution": "none"}])
    with pytest.raises(ValueError, match="boxed"):
        load_math(bad)
    env = MathPythonEnv(train_path=str(math))
    assert len(env.tasks("train")) == 3 and len(env.tasks("test")) == 10


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}+1}") == "x^{2}+1"
    assert last_boxed("\\fbox{3}") == "3" and last_boxed("none") is None
    assert last_boxed("\\boxed{unclosed") is None


@pytest.mark.parametrize(
    "gold,answer,expected",
    [
        ("\\frac{100}{101}", "\\boxed{\\frac{100}{101}}", 1.0),
        ("\\frac{100}{101}", "100/101", 1.0),
        ("1+\\sqrt{2}", "\\sqrt{2} + 1", 1.0),
        ("1+\\sqrt{2}", "So the root is $1+\\sqrt{2}$.", 1.0),
        ("649", "The last three digits are \\boxed{649}", 1.0),
        ("649", "\\boxed{648}", 0.0),
        ("1+\\sqrt{2}", "1-\\sqrt{2}", 0.0),
        ("405", None, 0.0),
        ("405", "   ", 0.0),
        ("405", "I do not know", 0.0),
    ],
)
def test_math_verify_reward(gold, answer, expected):
    assert math_reward(gold, answer) == expected


def test_python_tool_episode(env):
    task = env.tasks()[0]
    state = env.reset(task)
    obs = env.step(state, ToolCall("python", {"code": "import sympy\nprint(sum(sympy.primerange(1000)))"}))
    assert obs.strip() == "76127"
    assert "unknown tool" in env.step(state, ToolCall("bash", {"cmd": "ls"}))
    assert "string argument 'code'" in env.step(state, ToolCall("python", {"src": "1"}))
    assert len(state.history) == 3
    assert env.reward(state, obs.strip()) == 1.0 and env.reward(state, "76128") == 0.0
    child = env.fork(state)
    env.step(child, ToolCall("python", {"code": "print(1)"}))
    assert len(child.history) == 4 and len(state.history) == 3


def test_bombs_in_some_episodes_leave_the_others_intact(env):
    tasks = env.tasks()
    states = [env.reset(t) for t in tasks]
    bombs = [
        "while True: pass",
        "x = bytearray(8 * 1024 ** 3)",
        "import os\nwhile True: os.fork()",
        "print('z' * 100_000_000)",
        "import socket; socket.create_connection(('1.1.1.1', 80))",
    ]
    items = []
    for i, state in enumerate(states):
        code = bombs[i // 2] if i % 2 else f"print({i} * 111)"
        items.append((state, ToolCall("python", {"code": code})))
    with ThreadPoolExecutor(4) as pool:  # concurrent episodes, as the agent loop's tool pool runs them
        observations = list(pool.map(lambda item: env.step(*item), items))
    for i, obs in enumerate(observations):
        if i % 2 == 0:
            assert obs.strip() == str(i * 111)
        else:
            assert obs.strip() and str(i * 111) not in obs
    assert "CPU-time limit" in observations[1] and "MemoryError" in observations[3]
    assert "os.fork is not allowed" in observations[5] and "[output truncated]" in observations[7]
    assert "socket" in observations[9]


def test_episode_through_the_agent_loop(tmp_path):
    """The env behind the real ReAct parser and agent loop (a word-level tokenizer whose
    action tokens are whole tool calls / answers; the prompt words are [UNK])."""
    from trace_mega.config import RolloutConfig
    from trace_mega.envs.tokenizer import build_tiny_tokenizer
    from trace_mega.rollout.agent_loop import AgentLoop

    path = _write(tmp_path / "one.jsonl", [{"problem": "What is 1 + 2 + ... + 100?", "answer": "5050"}])
    env = MathPythonEnv(train_path=str(path), limits=SandboxLimits(wall_s=30.0))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(101)))"}}</tool_call>'
    trees = {}
    for answer in ("5050", "5051"):
        tok = build_tiny_tokenizer(["5050"], [call, f"<answer>{answer}</answer>"])
        loop = AgentLoop(
            env,
            WholeTokenEngine(tok, [call, f"<answer>{answer}</answer>"]),
            tok,
            RolloutConfig(max_turns=4, max_new_tokens_per_turn=4, max_total_tokens=4096),
        )
        (trees[answer],) = loop.rollout(env.tasks("train"), [2])
        loop.close()
    for answer, reward in (("5050", 1.0), ("5051", 0.0)):
        tree = trees[answer]
        for leaf in tree.leaves():
            tool_node, final = (tree.nodes[n] for n in tree.path(leaf)[1:])
            assert tool_node.observation.strip() == "5050" and final.reward == reward
    env.close()


def test_usual_math_layouts_jsonl_json_and_parquet(tmp_path):
    """AIME / AMC / OlympiadBench / verl-parquet field names; the source is the row's or the file's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    aime = _write(tmp_path / "aime24.jsonl", [{"id": 60, "Problem": "Find x.", "Answer": "204"}])
    amc = tmp_path / "amc23.json"
    amc.write_text(json.dumps({"data": [{"question": "How many?", "answer": 7.0}]}))
    olymp = _write(tmp_path / "olympiadbench.jsonl", [{"question": "Solve.", "final_answer": ["$\\frac{1}{2}$"]}])
    verl = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": "math500",
                    "prompt": [{"role": "user", "content": "Compute 2+2."}],
                    "reward_model": {"style": "rule", "ground_truth": "4"},
                },
                {
                    "data_source": "minerva",
                    "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q2"}],
                    "reward_model": {"style": "rule", "ground_truth": "1"},
                },
            ]
        ),
        verl,
    )
    (a,) = load_math(aime)
    assert (a.task_id, a.gold_answer, a.meta["source"], a.messages[-1]["content"]) == (
        "aime24-60",
        "204",
        "aime24",
        "Find x.",
    )
    (m,) = load_math(amc)
    assert (m.gold_answer, m.meta["source"]) == ("7.0", "amc23")
    (o,) = load_math(olymp)
    assert o.gold_answer == "\\frac{1}{2}" and math_reward(o.gold_answer, "0.5") == 1.0
    v = load_math(verl)
    assert [(t.meta["source"], t.gold_answer, t.messages[-1]["content"]) for t in v] == [
        ("math500", "4", "Compute 2+2."),
        ("minerva", "1", "Q2"),
    ]
    with pytest.raises(ValueError, match="needs one of the fields"):
        load_math(_write(tmp_path / "x.jsonl", [{"text": "no problem field", "answer": "1"}]))
    env = MathPythonEnv(test_path=[str(aime), str(verl)])
    assert [t.meta["source"] for t in env.tasks("test")] == ["aime24", "math500", "minerva"]
    env.close()


def test_bad_math_rows_name_the_place_or_are_skipped(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trace_mega.envs.records import DataError

    path = tmp_path / "aime.jsonl"
    path.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "no answer"}\n{"problem": \n')
    with pytest.raises(DataError) as err:
        load_math(path)
    assert str(err.value) == (
        f"{path}:2: no answer field (answer, Answer, final_answer, ground_truth, expected_answer, target) "
        "and no \\boxed{} in 'solution'"
    )
    with caplog.at_level("WARNING", logger="trace_mega.envs.records"):
        tasks = load_math(path, on_bad_row="skip")
    assert [t.gold_answer for t in tasks] == ["2"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: skipped 2 bad row(s) of 3 (on_bad_row: skip); the first: {path}:2: no answer field "
        "(answer, Answer, final_answer, ground_truth, expected_answer, target) and no \\boxed{} in 'solution'"
    ]
    as_json = tmp_path / "math.json"
    as_json.write_text(json.dumps([{"problem": "p", "answer": "1"}, {"problem": "", "answer": "2"}]))
    with pytest.raises(DataError, match=r"math\.json row 1: a math row needs one of the fields problem, "):
        load_math(as_json)
    verl = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "solution": 3}]), verl)
    with pytest.raises(DataError, match=r"train\.parquet row 0: no answer field"):
        load_math(verl)
    truncated = tmp_path / "cut.json"
    truncated.write_text('[{"problem": "p", "answer": "1"},\n {"problem": ')
    with pytest.raises(DataError, match=r"cut\.json:2: invalid JSON \(Expecting value: column 14\)$"):
        load_math(truncated, on_bad_row="skip")  # an unparsable JSON document cannot be skipped row by row
    env = MathPythonEnv(train_path=str(path), on_bad_row="skip", isolation="weak")
    assert len(env.tasks("train")) == 1
    env.close()
    with pytest.raises(ValueError, match="on_bad_row must be one of error, skip"):
        MathPythonEnv(on_bad_row="warn", isolation="weak")
