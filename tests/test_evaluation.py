"""pass@k (unbiased), mean@n, per-benchmark rows, reports; evaluation through the real agent loop."""

import itertools
import json
import math
import statistics

import pytest

from trace_mega.config import EvalConfig
from trace_mega.evaluation import TaskResult, evaluate, group_of, pass_at_k, summarize
from trace_mega.rollout.engines.base import Completion, Engine


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_mean_over_all_k_subsets(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            exact = statistics.fmean(float(any(s)) for s in subsets)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_group_precedence():
    assert group_of({"source": "aime24", "level": 3}) == "aime24"
    assert group_of({"dataset": "hotpotqa"}) == "hotpotqa" and group_of({"category": "miss_func"}) == "miss_func"
    assert group_of({"data_source": "math500", "source": "x"}) == "math500"
    assert group_of({"start": 0}, "synthetic_tools") == "synthetic_tools"


def test_summary_rows_macro_markdown_and_json(tmp_path):
    results = [
        TaskResult("a0", "aime", [1, 0, 0, 0]),
        TaskResult("a1", "aime", [1, 1, 0, 0]),
        TaskResult("m0", "math500", [0, 0, 0, 0]),
    ]
    rep = summarize(results, ks=[1, 2, 4], split="test")
    assert list(rep.rows) == ["aime", "math500", "all", "macro"]
    aime = rep.rows["aime"]
    assert aime["pass@1"] == pytest.approx(0.375) and aime["mean@4"] == pytest.approx(0.375)
    assert aime["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2) and aime["pass@4"] == 1.0
    assert rep.rows["math500"]["pass@4"] == 0.0
    assert rep.rows["all"]["pass@1"] == pytest.approx(0.25) and rep.rows["all"]["tasks"] == 3
    assert rep.rows["macro"]["pass@1"] == pytest.approx(0.1875) and rep.rows["macro"]["pass@4"] == 0.5
    m = rep.metrics()
    assert m["eval/test/pass@1"] == pytest.approx(0.25) and m["eval/test/aime/pass@2"] == aime["pass@2"]
    assert m["eval/test/reward"] == m["eval/test/mean@4"] and m["eval/test/macro/pass@4"] == 0.5
    # tasks by solved samples 0..4: m0 none, a0 one, a1 two; the all-0 / all-1 shares per group
    assert rep.solved_histogram() == [1, 1, 1, 0, 0]
    assert m["eval/test/none_solved"] == pytest.approx(1 / 3) and m["eval/test/all_solved"] == 0.0
    assert m["eval/test/math500/none_solved"] == 1.0 and m["eval/test/aime/none_solved"] == 0.0
    md = rep.markdown()
    assert md.splitlines()[0] == "| test | tasks | mean@4 | pass@1 | pass@2 | pass@4 |"
    assert "| solved samples | 0 | 1 | 2 | 3 | 4 |" in md and "| tasks | 1 | 1 | 1 | 0 | 0 |" in md
    assert "| aime | 2 | 37.5 | 37.5 | 66.7 | 100.0 |" in md and "| **macro** | 3 | 18.8 |" in md
    js, mdp = rep.write(tmp_path, "test")
    data = json.loads(js.read_text())
    assert data["solved_histogram"] == [1, 1, 1, 0, 0]
    assert data["rows"]["aime"]["pass@4"] == 1.0 and data["tasks"][2] == {
        "task_id": "m0",
        "group": "math500",
        "rewards": [0, 0, 0, 0],
    }
    assert mdp.read_text() == md
    # Continuous rewards (F1): mean@n averages the scores, pass@k counts rewards above the threshold.
    f1 = summarize([TaskResult("q", "hotpotqa", [0.4, 0.8])], ks=[1, 2])
    assert list(f1.rows) == ["all"] and f1.rows["all"]["mean@2"] == pytest.approx(0.6)
    assert f1.rows["all"]["pass@1"] == 0.5 and f1.rows["all"]["pass@2"] == 1.0
    assert f1.solved_histogram() == [0, 1, 0] and f1.rows["all"]["all_solved"] == 0.0
    with pytest.raises(ValueError, match="same number"):
        summarize([TaskResult("a", "g", [1, 0]), TaskResult("b", "g", [1])], ks=[1])
    with pytest.raises(ValueError, match="every k"):
        summarize(results, ks=[8])


class ScriptedAnswers(Engine):
    """Answers at once; the j-th episode of problem word P in one call gives script[P][j]."""

    def __init__(self, tok, script):
        super().__init__()
        self.tok, self.script = tok, script

    def generate(self, prefixes, sampling):
        seen: dict[str, int] = {}
        out = []
        for prefix in prefixes:
            words = self.tok.convert_ids_to_tokens(prefix)
            (word,) = [w for w in self.script if w in words]
            j = seen.get(word, 0)
            seen[word] = j + 1
            token = self.tok.convert_tokens_to_ids(f"<answer>{self.script[word][j]}</answer>")
            out.append(Completion(token_ids=[token], logprobs=[-0.1], finish_reason="stop"))
        return out

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass


def test_evaluate_math_benchmarks_through_the_agent_loop(tmp_path):
    """Two benchmark files (JSONL and Parquet) of math_python, the real ReAct parser, agent
    loop and math-verify reward; the scripted engine fixes how many samples are right."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trace_mega.config import RolloutConfig
    from trace_mega.envs.math_python import MathPythonEnv
    from trace_mega.envs.tokenizer import build_tiny_tokenizer
    from trace_mega.rollout.agent_loop import AgentLoop

    (tmp_path / "aime24.jsonl").write_text(
        json.dumps({"id": 1, "problem": "p0", "answer": "4"})
        + "\n"
        + json.dumps({"id": 2, "problem": "p1", "answer": "5"})
        + "\n"
    )
    pq.write_table(pa.Table.from_pylist([{"problem": "p2", "answer": "4"}]), tmp_path / "math500.parquet")
    env = MathPythonEnv(test_path=[str(tmp_path / "aime24.jsonl"), str(tmp_path / "math500.parquet")])
    tok = build_tiny_tokenizer(["p0", "p1", "p2"], ["<answer>4</answer>", "<answer>5</answer>"])
    script = {"p0": [4, 5, 5, 5], "p1": [5, 5, 4, 4], "p2": [5, 5, 5, 5]}
    loop = AgentLoop(env, ScriptedAnswers(tok, script), tok, RolloutConfig(max_turns=2, max_new_tokens_per_turn=2))
    try:
        rep = evaluate(loop, env, EvalConfig(samples_per_task=4, batch_tasks=2))
    finally:
        loop.close()
        env.close()
    assert list(rep.rows) == ["aime24", "math500", "all", "macro"] and rep.ks == [1, 2, 4]
    assert rep.rows["aime24"]["pass@1"] == pytest.approx(0.375)
    assert rep.rows["aime24"]["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert rep.rows["math500"]["pass@4"] == 0.0 and rep.rows["all"]["tasks"] == 3
    assert [t.rewards for t in rep.tasks] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_bfcl_categories_are_report_rows():
    """Real BFCL v4 tasks of two categories; the official checker scores ground-truth replays 1
    and truncated replays 0, and the report has one row per category."""
    pytest.importorskip("bfcl_eval")
    from trace_mega.envs.bfcl import BFCLMultiTurnEnv, corrupt, ground_truth_calls, replay

    env = BFCLMultiTurnEnv(categories=("base", "miss_param"), max_tasks_per_category=2)
    results = []
    for i, task in enumerate(env.tasks("test")):
        gold = ground_truth_calls(task)
        rewards = [replay(env, task, gold), replay(env, task, corrupt(gold, "drop"))]
        results.append(TaskResult(task.task_id, group_of(task.meta), rewards if i % 2 else rewards[::-1]))
    rep = summarize(results, ks=[1, 2])
    assert list(rep.rows) == ["base", "miss_param", "all", "macro"]
    for cat in ("base", "miss_param"):
        assert rep.rows[cat]["tasks"] == 2 and rep.rows[cat]["pass@1"] == 0.5 and rep.rows[cat]["pass@2"] == 1.0
