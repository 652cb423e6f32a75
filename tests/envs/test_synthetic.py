"""Synthetic environments: known success probabilities, exact prefix values, the tiny tokenizer."""

import itertools
import random
import statistics

import pytest

from trace_mega.envs import ENVS, build_env
from trace_mega.envs.base import ToolCall
from trace_mega.envs.synthetic import (
    ACTION_TOKENS,
    ANSWER_DONE,
    MOVE_LEFT,
    MOVE_RIGHT,
    REVEAL,
    SyntheticEnv,
    SyntheticToolsEnv,
)
from trace_mega.rollout.react import ReactScaffold, parse_turn

REVEAL_CALL = ToolCall("reveal", {})
LEFT, RIGHT = ToolCall("move", {"dir": "left"}), ToolCall("move", {"dir": "right"})


def test_registry_and_options():
    assert {"synthetic", "synthetic_tools"} <= set(ENVS.names())
    env = build_env("synthetic", num_tasks=5, num_bits=2, seed=3)
    assert len(env.tasks()) == 5 and env.num_bits == 2
    with pytest.raises(ValueError, match="num_tasks"):
        build_env("synthetic", num_tasks=0)
    with pytest.raises(ValueError, match="width"):
        build_env("synthetic_tools", width=1)
    with pytest.raises(ValueError, match="slips"):
        build_env("synthetic_tools", slips=[1.5])


def test_per_prompt_probabilities_are_u_shaped():
    env = SyntheticEnv(num_tasks=2000, beta=0.5, seed=0)
    p = [t.meta["p"] for t in env.tasks()]
    extreme = sum(x < 0.2 or x > 0.8 for x in p) / len(p)
    # Beta(0.5, 0.5): P(p < .2 or p > .8) = (4/pi) asin(sqrt(.2)) = 0.590; uniform would give 0.4
    assert extreme == pytest.approx(0.590, abs=0.04)
    assert all(0.0 <= x <= 1.0 for x in p)


def test_true_value_is_exact_martingale():
    """V_0 = p and E[V_{k+1} | V_k] = V_k, by enumerating both outcomes of every revealed digit."""
    env = SyntheticEnv(num_tasks=8, num_bits=3, seed=1)
    for task in env.tasks():
        state = env.reset(task)
        assert env.true_value(state) == pytest.approx(task.meta["p"])
        frontier = [state]
        for _ in range(3):
            nxt = []
            for s in frontier:
                children = []
                for bit in (0, 1):  # force each digit value by searching forks
                    for _ in range(64):
                        c = env.fork(s)
                        if env.step(c, REVEAL_CALL) == f"bit {bit}":
                            children.append(c)
                            break
                assert len(children) == 2
                assert (env.true_value(children[0]) + env.true_value(children[1])) / 2 == pytest.approx(
                    env.true_value(s)
                )
                nxt += children
            frontier = nxt
        assert env.step(frontier[0], REVEAL_CALL) == "empty"  # no more digits


def test_success_rate_matches_true_value_monte_carlo():
    env = SyntheticEnv(num_tasks=3, num_bits=2, seed=2)
    for task in env.tasks():
        base = env.reset(task)
        env.step(base, REVEAL_CALL)
        v = env.true_value(base)
        wins = sum(env.reward(env.fork(base), "done") for _ in range(3000))
        assert wins / 3000 == pytest.approx(v, abs=0.03)
        assert env.reward(base, None) == 0.0
        assert env.reward(base, "x") == env.reward(base, "x")  # reward does not consume randomness


def test_fork_is_independent_and_does_not_mutate():
    env = SyntheticEnv(num_tasks=1, num_bits=8, seed=4)
    s = env.reset(env.tasks()[0])
    before = (s.data["lo"], s.data["width"], s.data["revealed"])
    seqs = set()
    for _ in range(20):
        f = env.fork(s)
        seqs.add(tuple(env.step(f, REVEAL_CALL) for _ in range(8)))
    assert len(seqs) > 1 and (s.data["lo"], s.data["width"], s.data["revealed"]) == before


def test_walk_dynamics_and_reward():
    env = SyntheticToolsEnv(width=5, max_distance=2, slips=[0.0], seed=0)
    task = next(t for t in env.tasks() if t.meta["start"] == 0 and t.meta["goal"] == 2)
    assert task.messages[1]["content"] == "start 0 goal 2"
    s = env.reset(task)
    assert env.step(s, LEFT) == "at 0 wall" and s.data["pos"] == 0
    assert env.step(s, RIGHT) == "at 1"
    assert env.reward(s, "done") == 0.0
    assert env.step(s, RIGHT) == "at 2"
    assert env.reward(s, "done") == 1.0 and env.reward(s, None) == 0.0 and env.reward(s, "yes") == 0.0
    assert env.step(s, ToolCall("move", {"dir": "up"})).startswith("Error")
    assert len(env.tasks()) == 2 * (5 - 1) + 2 * (5 - 2)
    icy = SyntheticToolsEnv(slips=[0.25])
    assert all(t.messages[1]["content"].endswith(" ice") for t in icy.tasks())


def test_uniform_policy_success_exact_vs_monte_carlo_and_spread():
    env = SyntheticToolsEnv(seed=0)
    max_turns = 6
    exact = {t.task_id: env.uniform_action_success(t, max_turns) for t in env.tasks()}
    rng = random.Random(0)
    for task in [env.tasks()[0], env.tasks()[-1], env.tasks()[len(env.tasks()) // 2]]:
        wins = 0
        for _ in range(4000):
            s = env.fork(env.reset(task))
            for _ in range(max_turns):
                a = rng.randrange(3)
                if a == 2:
                    wins += env.reward(s, "done")
                    break
                env.step(s, LEFT if a == 0 else RIGHT)
        assert wins / 4000 == pytest.approx(exact[task.task_id], abs=0.025)
    rates = sorted(exact.values())
    # low but nonzero for a random policy; harder (farther, icy) prompts are rarer successes
    assert 0 < rates[0] < 0.01 and 0.1 < rates[-1] < 0.3
    assert sum(rates) / len(rates) < 0.1


def test_tiny_tokenizer_one_token_actions():
    env = SyntheticToolsEnv()
    tok = env.tokenizer
    assert len(tok) <= 64  # fits the default tiny model's vocabulary
    for a in ACTION_TOKENS:
        ids = tok.encode(a, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == a
        assert ids[0] in env.stop_token_ids
    assert env.stop_token_ids == ReactScaffold(tok).stop_token_ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 0
    # the parser reads the JSON inside one-token actions
    text = tok.decode(tok.encode("at 3 " + MOVE_RIGHT, add_special_tokens=False), skip_special_tokens=True)
    p = parse_turn(text, env.tools)
    assert p.error is None and p.tool_calls[0].arguments == {"dir": "right"} and p.thought == "at 3"
    assert parse_turn(tok.decode(tok.encode(ANSWER_DONE)), env.tools).final_answer == "done"
    assert parse_turn(REVEAL, env.tools).error.startswith("unknown tool 'reveal'")
    # canonical: encode(decode(x)) == x on in-vocabulary sequences
    vocab_ids = [i for i in range(len(tok)) if tok.convert_ids_to_tokens(i) not in ("[UNK]",)]
    rng = random.Random(0)
    for _ in range(200):
        seq = [rng.choice(vocab_ids) for _ in range(rng.randint(1, 12))]
        assert tok.encode(tok.decode(seq), add_special_tokens=False) == seq
    assert MOVE_LEFT != MOVE_RIGHT and len(set(itertools.chain(ACTION_TOKENS))) == 4


def test_reseed_replays_episode_randomness():
    def draws(env):
        s = env.reset(env.tasks()[0])
        return [env.step(env.fork(s), REVEAL_CALL) for _ in range(16)]

    a, b = SyntheticEnv(num_tasks=2, seed=0), SyntheticEnv(num_tasks=2, seed=99)
    a.reseed(7)
    b.reseed(7)
    assert draws(a) == draws(b)  # the same per-step seed replays the same episodes
    a.reseed(8)
    assert len({tuple(draws(a)) for _ in range(3)} | {tuple(draws(b))}) > 1


def _greedy_success(env, task, max_turns, episodes, rng_seed=0):
    """Monte Carlo success of the policy that moves towards the goal and answers once on it."""
    env.reseed(rng_seed)
    wins = 0
    for _ in range(episodes):
        s = env.reset(task)
        for _ in range(max_turns):
            if s.data["pos"] == task.meta["goal"]:
                wins += env.reward(s, "done")
                break
            env.step(s, RIGHT if task.meta["goal"] > s.data["pos"] else LEFT)
    return wins / episodes


def test_slip_levels_are_stated_in_the_prompt_and_spread_difficulty():
    env = SyntheticToolsEnv(width=5, max_distance=2, slips=[0.0, 0.3, 0.9], slip_in_prompt="level", seed=0)
    by_slip = {}
    for t in env.tasks():
        by_slip.setdefault(t.meta["slip"], []).append(t)
        words = t.messages[1]["content"]
        assert words == f"start {t.meta['start']} goal {t.meta['goal']}" + (
            f" ice {round(10 * t.meta['slip'])}" if t.meta["slip"] > 0 else ""
        )
    assert sorted(by_slip) == [0.0, 0.3, 0.9] and {len(v) for v in by_slip.values()} == {14}
    # the default rendering is unchanged: a bare "ice" flag whatever the level
    assert {t.messages[1]["content"].split(" ice")[-1] for t in SyntheticToolsEnv(slips=[0.3, 0.9]).tasks()} == {""}
    # the level is a real difficulty: under one fixed (greedy) policy, dry prompts always succeed
    # and "ice 9" two cells away almost never does in 6 turns (P = 1 - 0.9^5 - 5 * 0.1 * 0.9^4 = 0.081)
    far = [t for t in by_slip[0.9] if abs(t.meta["goal"] - t.meta["start"]) == 2]
    assert all(_greedy_success(env, t, 6, 50) == 1.0 for t in by_slip[0.0])
    assert statistics.fmean(_greedy_success(env, t, 6, 400, i) for i, t in enumerate(far)) == pytest.approx(
        0.081, abs=0.03
    )
    # and for the uniformly random policy the level orders the success rate of every (start, goal)
    rate = {t.task_id: env.uniform_action_success(t, 6) for t in env.tasks()}
    for t in by_slip[0.0]:
        s, g = t.meta["start"], t.meta["goal"]
        assert rate[f"walk-{s}-{g}-0"] > rate[f"walk-{s}-{g}-0.3"] > rate[f"walk-{s}-{g}-0.9"]


def test_min_distance_and_slip_in_prompt_are_validated():
    env = SyntheticToolsEnv(width=4, min_distance=0, max_distance=1, slips=[0.0])
    assert sum(t.meta["start"] == t.meta["goal"] for t in env.tasks()) == 4 and len(env.tasks()) == 4 + 2 * 3
    with pytest.raises(ValueError, match="slip_in_prompt must be one of flag, level"):
        SyntheticToolsEnv(slip_in_prompt="percent")
    with pytest.raises(ValueError, match="tenths"):
        SyntheticToolsEnv(slips=[0.25], slip_in_prompt="level")
    with pytest.raises(ValueError, match="min_distance"):
        SyntheticToolsEnv(min_distance=3, max_distance=2)
    from trace_mega.envs import check_env  # typed options: unknown keys are errors where the env is built

    check_env("synthetic_tools", {"slips": [0.0, 0.9], "slip_in_prompt": "level", "min_distance": 1})
    with pytest.raises(ValueError, match="slip_level"):
        check_env("synthetic_tools", {"slip_level": True})


def test_walls_add_unsolvable_dry_copies_stated_in_the_prompt():
    env = SyntheticToolsEnv(width=5, max_distance=1, slips=[0.0, 0.7], slip_in_prompt="level", walls=True, seed=0)
    walled = [t for t in env.tasks() if t.meta["wall"]]
    dry = [t for t in env.tasks() if not t.meta["wall"] and t.meta["slip"] == 0.0]
    assert len(walled) == len(dry) == 8 and len(env.tasks()) == 24
    for t in walled:
        assert t.messages[1]["content"] == f"start {t.meta['start']} goal {t.meta['goal']} wall"
        # no policy reaches the goal: the greedy one never does, the random one's exact rate is 0
        assert _greedy_success(env, t, 6, 20) == 0.0 and env.uniform_action_success(t, 6) == 0.0
        s = env.reset(t)
        obs = env.step(s, RIGHT if t.meta["goal"] > t.meta["start"] else LEFT)
        assert obs == f"at {t.meta['start']} wall" and s.data["pos"] == t.meta["start"]
    # the dry tasks they copy stay solvable, and a wall task is a different prompt
    assert all(_greedy_success(env, t, 6, 20) == 1.0 for t in dry)
    assert len({t.messages[1]["content"] for t in env.tasks()}) == len(env.tasks())
    # min_distance 0 adds no walled goal = start task (it would be solved at once)
    assert not any(
        t.meta["wall"] and t.meta["start"] == t.meta["goal"]
        for t in SyntheticToolsEnv(width=4, min_distance=0, max_distance=1, slips=[0.0], walls=True).tasks()
    )


def test_kind_names_the_level_the_prompt_states():
    env = SyntheticToolsEnv(width=5, max_distance=1, slips=[0.0, 0.7], slip_in_prompt="level", walls=True)
    kinds = {SyntheticToolsEnv.kind(t): t.messages[1]["content"].split()[4:] for t in env.tasks()}
    assert kinds == {"dry": [], "ice7": ["ice", "7"], "wall": ["wall"]}
