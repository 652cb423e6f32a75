"""`synthetic_levels`: disjoint seeded splits, the stated level, the walk's reward, the greedy ceiling."""

import itertools
import statistics

import pytest

from trace_mega.commands.pretrain import TRANSCRIPT_POLICIES, PretrainConfig, WalkTranscriptEngine
from trace_mega.config import EnvConfig, EvalConfig, RolloutConfig
from trace_mega.envs import build_env, check_env
from trace_mega.envs.base import Task, ToolCall
from trace_mega.envs.synthetic_levels import SyntheticLevelsEnv, prompt_text, split_of
from trace_mega.evaluation import evaluate
from trace_mega.rollout.agent_loop import AgentLoop

LEFT, RIGHT = ToolCall("move", {"dir": "left"}), ToolCall("move", {"dir": "right"})


def _params(task) -> tuple[int, int, int]:
    m = task.meta
    return m["start"], m["goal"], round(10 * m["slip"])


def test_splits_are_disjoint_and_cover_every_task():
    env = SyntheticLevelsEnv()
    train, test = env.tasks("train"), env.tasks("test")
    every = {(s, g, n) for s, g, n in itertools.product(range(10), range(10), range(10)) if 1 <= abs(g - s) <= 9}
    assert len(every) == 900
    assert {_params(t) for t in train} | {_params(t) for t in test} == every
    assert len(train) + len(test) == 900  # no task twice within a split either
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert not {t.messages[1]["content"] for t in train} & {t.messages[1]["content"] for t in test}
    assert all(t.meta["split"] == "train" for t in train) and all(t.meta["split"] == "test" for t in test)
    # hundreds per split, the test share near test_fraction, every level in both splits
    assert len(test) >= 200 and len(train) >= 500 and abs(len(test) / 900 - 0.3) < 0.05
    for split in (train, test):
        assert {t.meta["benchmark"] for t in split} == {f"ice{n}" for n in range(10)}
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("validation")


def test_task_set_is_a_function_of_its_options():
    a, b = SyntheticLevelsEnv(), SyntheticLevelsEnv(seed=123)  # the episode seed never moves the split
    for split in ("train", "test"):
        assert [(t.task_id, t.messages, t.meta) for t in a.tasks(split)] == [
            (t.task_id, t.messages, t.meta) for t in b.tasks(split)
        ]
    other = SyntheticLevelsEnv(split_seed=1)
    assert {t.task_id for t in other.tasks("test")} != {t.task_id for t in a.tasks("test")}
    assert split_of(0, 3, 5, 2, 0.3) == split_of(0, 3, 5, 2, 0.3)
    assert {split_of(0, 3, 5, 2, f) for f in (1e-9, 1 - 1e-9)} == {"train", "test"}  # a threshold on one number
    small = SyntheticLevelsEnv(width=4, max_distance=2, levels=[0, 5], test_fraction=0.5)
    assert len(small.tasks("train")) + len(small.tasks("test")) == 2 * (2 * 3 + 2 * 2)


def test_prompt_states_cells_and_level_never_a_probability():
    env = SyntheticLevelsEnv()
    for t in env.tasks("train") + env.tasks("test"):
        s, g, n = _params(t)
        text = t.messages[1]["content"]
        assert text == prompt_text(s, g, n) == f"start {s} goal {g} ice {n}"
        assert "." not in text and all(w in ("start", "goal", "ice") or w.isdigit() for w in text.split())
        assert env.tokenizer(text, add_special_tokens=False)["input_ids"]  # every word is one vocabulary token
    # The level is difficulty, not the success probability: at a fixed level the greedy ceiling spans
    # nearly [0, 1] over the distances, and at a fixed distance it falls as the level rises.
    by_level = {n: [env.greedy_success(t, 10) for t in env.tasks("test") if _params(t)[2] == n] for n in (4, 6)}
    assert all(max(v) - min(v) > 0.5 for v in by_level.values())
    for d in range(1, 10):
        ceil = [env.greedy_success(_task(d, n), 10) for n in range(10)]
        assert ceil == sorted(ceil, reverse=True) and ceil[0] == pytest.approx(1.0)


def _task(d: int, level: int) -> Task:
    return Task(task_id="x", messages=[], meta={"start": 0, "goal": d, "slip": level / 10, "wall": False})


def test_walk_reward_and_dynamics():
    env = SyntheticLevelsEnv()
    task = next(t for t in env.tasks("train") + env.tasks("test") if _params(t) == (0, 2, 0))
    s = env.reset(task)
    assert env.step(s, LEFT) == "at 0 wall" and s.data["pos"] == 0
    assert env.step(s, RIGHT) == "at 1" and env.reward(s, "done") == 0.0
    assert env.step(s, RIGHT) == "at 2"
    assert env.reward(s, "done") == 1.0 and env.reward(s, None) == 0.0 and env.reward(s, "yes") == 0.0
    assert env.step(s, ToolCall("move", {"dir": "up"})).startswith("Error")
    # ice 9: 90% of the moves slip (the agent stays), reproducibly from the reseeded episode RNG
    icy = next(t for t in env.tasks("train") + env.tasks("test") if _params(t) == (5, 6, 9))
    runs = []
    for _ in range(2):
        env.reseed(7)
        st, stays = env.reset(icy), []
        for i in range(400):
            before = st.data["pos"]
            obs = env.step(st, RIGHT if i % 2 == 0 else LEFT)
            if "wall" not in obs:
                stays.append(st.data["pos"] == before)
        runs.append(stays)
    assert runs[0] == runs[1] and 0.85 < statistics.fmean(runs[0]) < 0.95


def test_options_are_validated():
    with pytest.raises(ValueError, match="levels"):
        SyntheticLevelsEnv(levels=[0, 10])
    with pytest.raises(ValueError, match="levels"):
        SyntheticLevelsEnv(levels=[3, 3])
    with pytest.raises(ValueError, match="test_fraction"):
        SyntheticLevelsEnv(test_fraction=1.0)
    with pytest.raises(ValueError, match="max_distance"):
        SyntheticLevelsEnv(width=5, max_distance=5)
    assert check_env("synthetic_levels", {"levels": [1, 2]}) is SyntheticLevelsEnv
    with pytest.raises(Exception, match="slips"):
        check_env("synthetic_levels", {"slips": [0.1]})


def _walker_loop(env, correct_action_prob: float, max_turns: int = 10) -> AgentLoop:
    cfg = PretrainConfig(
        env=EnvConfig(name="synthetic_levels"), correct_action_prob=correct_action_prob, max_turns=max_turns
    )
    return AgentLoop(
        env,
        WalkTranscriptEngine(env.tokenizer, cfg),
        env.tokenizer,
        RolloutConfig(max_turns=max_turns, max_new_tokens_per_turn=3, max_total_tokens=256),
    )


def test_greedy_ceiling_is_exact():
    env = SyntheticLevelsEnv()
    for params in [(0, 3, 5), (2, 8, 4), (9, 0, 2), (4, 5, 8)]:
        task = next(t for t in env.tasks("train") + env.tasks("test") if _params(t) == params)
        wins = 0
        for k in range(4000):
            env.reseed(k)
            st = env.reset(task)
            for _ in range(9):  # 10 turns: at most 9 moves, then the answer
                if st.data["pos"] == task.meta["goal"]:
                    break
                env.step(st, RIGHT if task.meta["goal"] > st.data["pos"] else LEFT)
            wins += env.reward(st, "done")
        assert wins / 4000 == pytest.approx(env.greedy_success(task, 10), abs=0.03)  # 4 sigma at p = 0.5


def test_eval_reads_the_test_split_with_a_row_per_level():
    env = SyntheticLevelsEnv(width=5, max_distance=4, levels=[0, 5, 8], test_fraction=0.5)
    loop = _walker_loop(env, correct_action_prob=1.0)
    try:
        report = evaluate(loop, env, EvalConfig(split="test", samples_per_task=2))
    finally:
        loop.close()
    test = {t.task_id: t for t in env.tasks("test")}
    assert {r.task_id for r in report.tasks} == set(test)  # the test split, every task, nothing else
    assert set(report.rows) == {"ice0", "ice5", "ice8", "all", "macro"}
    # the greedy walker solves every dry task (a goal <= 4 cells away in 10 turns)
    assert all(r.rewards == [1.0, 1.0] for r in report.tasks if test[r.task_id].meta["slip"] == 0)


def test_warm_start_transcripts_use_the_train_split_only():
    assert TRANSCRIPT_POLICIES.get("synthetic_levels") is WalkTranscriptEngine
    cfg = PretrainConfig(env=EnvConfig(name="synthetic_levels", options={"test_fraction": 0.3}))
    transcripts_env = build_env("synthetic_levels", **WalkTranscriptEngine.env_options(cfg))
    rl_env = build_env("synthetic_levels", test_fraction=0.3)
    assert [t.task_id for t in transcripts_env.tasks("train")] == [t.task_id for t in rl_env.tasks("train")]


def test_walker_success_is_the_transcript_walkers():
    env = SyntheticLevelsEnv()
    tasks = env.tasks("train") + env.tasks("test")
    assert max(abs(env.walker_success(t, 10, 1.0, 0.15) - env.greedy_success(t, 10)) for t in tasks) < 1e-12
    # the real transcript engine through the agent loop, 1,024 episodes of two tasks
    picked = [next(t for t in tasks if _params(t) == p) for p in [(1, 4, 3), (7, 2, 0)]]
    loop = _walker_loop(env, correct_action_prob=0.85)
    try:
        trees = loop.rollout(picked, [512, 512], seed=3)
    finally:
        loop.close()
    for task, tree in zip(picked, trees):
        exact = env.walker_success(task, 10, 0.85, 0.15)
        assert 0.2 < exact < 0.9 and statistics.fmean(tree.leaf_rewards()) == pytest.approx(exact, abs=0.07)
