"""BFCL v4 multi-turn episodes end to end through the real ReAct agent loop.

For a deterministic sample of tasks of every category, a scripted engine (a real
`Engine` that replays token ids, `bfcl_replay_engine.ReplayEngine`) emits, user
turn by user turn, the ground-truth calls in Qwen3's format, one
`<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>` per generation (the
scaffold stops generation at `</tool_call>`), then `<answer>…</answer><|im_end|>`
to end the turn. Everything else is real: the BFCL env and its simulators, the
`next_turn` protocol (miss_func reveals, miss_param clarifications), the ReAct
parser with schema validation, the chat-template rendering (a Qwen3-style
byte-level tokenizer built in code), the agent loop's waves, forks and tool pool,
and the official `multi_turn_checker` as the reward.

Checked: ground truth -> reward 1 at the leaf; the last call dropped or one
argument altered -> reward 0 although every call parsed and every user turn was
played (so the checker, not the parser or the turn count, rejects it); one node
per call and per answer; every user turn rendered with its message; the tool
observations equal a direct replay of the calls on the env; generated tokens
have loss 1 and the engine's log-probs, observation / user tokens loss 0 and
log-prob 0; the token stream of a path is the chat template's render of the
conversation; a continuation branched after the first user turn also scores 1.

Over the full sets (800 tasks; `BFCL_AGENT_LOOP_FULL=1`, 2.5-4 min, not run by
default), the same scripts through the loop give exactly the replay numbers of docs/results/envs.md:
ground truth 1 on all but the known dataset quirks (task 173 of each category,
miss_func_49: the parser rejects a ground-truth call), drop 0 on 800/800, alter 0
on all but tasks 38, 63, 139 (63 and 38 for miss_func). The sample excludes those.
"""

import os
import random
import time

import pytest

pytest.importorskip("bfcl_eval", reason="pip install --no-deps -r requirements/nodeps.txt")

from bfcl_replay_engine import ReplayEngine, qwen3_style_tokenizer, replay_logprob, tool_call_text  # noqa: E402

from trace_mega.config import RolloutConfig  # noqa: E402
from trace_mega.envs.bfcl import CATEGORIES, BFCLMultiTurnEnv, corrupt, ground_truth_calls  # noqa: E402
from trace_mega.rollout.agent_loop import AgentLoop  # noqa: E402
from trace_mega.rollout.react import ReactScaffold  # noqa: E402

PER_CATEGORY = 5
# Ground truth the ReAct parser rejects (docs/envs.md, "Dataset quirks"), and altered
# arguments the official checker cannot see (docs/results/envs.md, "Measured (full sets, 800 tasks)").
PARSER_QUIRKS = {
    "multi_turn_base_173",
    "multi_turn_long_context_173",
    "multi_turn_miss_func_173",
    "multi_turn_miss_param_173",
    "multi_turn_miss_func_49",
}
ALTER_INVISIBLE = {38, 63, 139}
# Limits above what the ground truth needs (a long_context call can carry ~7 kB of text: 7k byte tokens).
CFG = RolloutConfig(max_turns=64, max_new_tokens_per_turn=16384, max_total_tokens=1_000_000)


def sample(tasks, category):
    """`PER_CATEGORY` tasks of `category`, the same on every run."""
    eligible = [
        t for t in tasks if t.task_id not in PARSER_QUIRKS and int(t.task_id.rsplit("_", 1)[1]) not in ALTER_INVISIBLE
    ]
    picked = random.Random(f"bfcl-agent-loop/{category}").sample(range(len(eligible)), PER_CATEGORY)
    return [eligible[i] for i in sorted(picked)]


def script(tok, turns):
    """Token ids of every generation: each call of a user turn, then the answer that ends the turn."""
    texts = []
    for i, calls in enumerate(turns):
        texts += [tool_call_text(c.name, c.arguments) for c in calls]
        texts.append(f"<answer>turn {i} done</answer><|im_end|>")
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def direct_observations(env, task, turns):
    """What the env returns for the calls when they are issued without the loop."""
    state, out = env.reset(task), []
    for i, calls in enumerate(turns):
        if i:
            env.next_turn(state, "done")
        out.append([env.step(state, c) for c in calls])
    return out


def run(env, tok, tasks, prompts, scripts, expand=False):
    engine = ReplayEngine(tok, list(zip(prompts, scripts)))
    with AgentLoop(env, engine, tok, CFG) as loop:
        trees = loop.rollout(tasks, [1] * len(tasks), seed=0)
        stats = loop.last_stats
        expanded = None
        if expand:  # one continuation from the end of the first user turn (its answer + the second question)
            points = []
            for ti, tree in enumerate(trees):
                first_final = next(n for n in tree.path(tree.leaves()[0]) if tree.nodes[n].kind == "final")
                points.append((ti, first_final, 1))
            loop.expand(trees, points, seed=1)
            expanded = (points, loop.last_stats)
    return trees, stats, engine, loop, expanded


@pytest.fixture(scope="module", params=CATEGORIES)
def episodes(request):
    category = request.param
    t0 = time.perf_counter()
    env = BFCLMultiTurnEnv(categories=(category,))
    tok = qwen3_style_tokenizer()
    tasks = sample(env.tasks("test"), category)
    gold = [ground_truth_calls(t) for t in tasks]
    prompts = [ReactScaffold(tok).prompt_ids(t) for t in tasks]
    out = {"category": category, "env": env, "tok": tok, "tasks": tasks, "ground_truth": gold}
    for mode in ("gold", "drop", "alter"):
        turns = gold if mode == "gold" else [corrupt(g, mode) for g in gold]
        scripts = [script(tok, g) for g in turns]
        trees, stats, engine, loop, expanded = run(env, tok, tasks, prompts, scripts, expand=mode == "gold")
        out[mode] = {
            "turns": turns,
            "scripts": scripts,
            "trees": trees,
            "stats": stats,
            "engine": engine,
            "loop": loop,
            "expanded": expanded,
        }
    print(f"bfcl agent loop, {category}: {time.perf_counter() - t0:.1f} s")
    return out


def leaf_path(tree):
    """The turn nodes of the bare rollout's path (a gold tree also has the expansion's leaf, added later)."""
    return [tree.nodes[n] for n in tree.path(min(tree.leaves()))[1:]]


def test_sample_covers_the_category(episodes):
    """The sample is 5 distinct multi-user-turn tasks with the category's feature."""
    tasks, gold = episodes["tasks"], episodes["ground_truth"]
    assert len({t.task_id for t in tasks}) == PER_CATEGORY
    assert all(len(t.meta["entry"]["question"]) >= 2 for t in tasks)
    if episodes["category"] == "miss_func":  # each task reveals functions mid-episode and then calls them
        for task, turns in zip(tasks, gold):
            held = task.meta["held_out_docs"]
            assert held and not {d["name"] for docs in held.values() for d in docs} & {
                t["function"]["name"] for t in task.tools
            }
            assert any(
                c.name in {d["name"] for d in docs}
                for turn, docs in held.items()
                for calls in turns[turn:]
                for c in calls
            ), task.task_id
    if episodes["category"] == "miss_param":
        assert any(turn == [] for g in gold for turn in g)  # a turn where the model must ask, not call


def test_ground_truth_scores_one(episodes):
    gold = episodes["gold"]
    rewards = {tree.prompt_id: leaf_path(tree)[-1].reward for tree in gold["trees"]}
    assert rewards == {t.task_id: 1.0 for t in episodes["tasks"]}
    stats = gold["stats"]
    n_calls = sum(len(c) for g in gold["turns"] for c in g)
    n_user_turns = sum(len(g) for g in gold["turns"])
    assert (stats.parse_errors, stats.length_cut_turns, stats.truncated_episodes, stats.tool_timeouts) == (0, 0, 0, 0)
    assert stats.tool_calls == n_calls and stats.final_answers == n_user_turns and stats.turns == n_calls + n_user_turns
    assert stats.successes == PER_CATEGORY
    # the episodes ran in lock step: the first waves batch all of them
    assert gold["engine"].batch_sizes[0] == PER_CATEGORY
    # every script turn was served exactly once, in order
    for prompt, turns in gold["engine"].scripts.items():
        assert gold["engine"].turns_served[prompt][: len(turns)] == list(range(len(turns)))


def test_turn_layout_observations_and_loss_mask(episodes):
    env, tok, gold = episodes["env"], episodes["tok"], episodes["gold"]
    end_call = tok.convert_tokens_to_ids("</tool_call>")
    assert end_call in gold["loop"].scaffold.stop_token_ids  # generation stops at the end of a call
    for task, turns, scripted, tree in zip(episodes["tasks"], gold["turns"], gold["scripts"], gold["trees"]):
        entry = task.meta["entry"]
        nodes = leaf_path(tree)
        expected_kinds = [k for calls in turns for k in ["tool"] * len(calls) + ["final"]]
        assert [n.kind for n in nodes] == expected_kinds, task.task_id
        assert all(n.reward is None for n in nodes[:-1]) and nodes[-1].reward == 1.0
        # user turns: every answer but the last is followed by the next user message
        finals = [n for n in nodes if n.kind == "final"]
        assert len(finals) == len(entry["question"]) and [bool(n.info.get("next_turn")) for n in finals] == [True] * (
            len(finals) - 1
        ) + [False]
        held = task.meta["held_out_docs"]
        for i, node in enumerate(finals[:-1], start=1):
            assert node.action == f"turn {i - 1} done"
            if i in held:  # miss_func: the held-out functions are revealed now
                assert "I have updated some more functions" in node.observation
                assert all(d["name"] in node.observation for d in held[i])
            else:
                assert node.observation == entry["question"][i][0]["content"]
        # tool observations: the loop ran exactly the scripted calls, in order, on the right state
        direct = [o for obs in direct_observations(env, task, turns) for o in obs]
        calls = [c for cs in turns for c in cs]
        tool_nodes = [n for n in nodes if n.kind == "tool"]
        assert [n.info["tool_calls"] for n in tool_nodes] == [
            [{"name": c.name, "arguments": c.arguments}] for c in calls
        ]
        assert [n.observation for n in tool_nodes] == direct and all(direct)
        # token layout: generated ids (loss 1, engine log-probs), then observation / user ids (loss 0)
        for turn, (node, ids) in enumerate(zip(nodes, scripted)):
            g = node.info["num_generated"]
            assert node.token_ids[:g] == ids and node.info["finish_reason"] == "stop"
            assert ids[-1] == (end_call if node.kind == "tool" else tok.eos_token_id)
            assert node.loss_mask == [1] * g + [0] * (len(node.token_ids) - g)
            assert node.logprobs[:g] == pytest.approx([replay_logprob(turn, j) for j in range(g)])
            assert node.logprobs[g:] == [0.0] * (len(node.token_ids) - g)
            assert (len(node.token_ids) > g) == (node is not nodes[-1])  # only the leaf has nothing after it
        # the stream of the path is the chat template's render of the whole conversation
        messages = list(task.messages)
        for node in nodes:
            messages.append({"role": "assistant", "content": node.text})
            if node.kind == "tool":
                messages.append({"role": "tool", "content": node.observation})
            elif node.info.get("next_turn"):
                messages.append({"role": "user", "content": node.observation})
        full = tok.apply_chat_template(messages, tools=task.tools, tokenize=True, return_dict=False)
        stream = tree.prefix_token_ids(min(tree.leaves()))
        assert stream == full[: len(stream)] and tok.decode(full[len(stream) :]) == "\n"
        text = tok.decode(stream)
        assert text.count("<|im_start|>user\n<tool_response>") == len(tool_nodes)
        assert text.count("<|im_start|>user\n") - len(tool_nodes) == len(entry["question"])
        assert text.count("<|im_start|>assistant\n") == len(nodes)


@pytest.mark.parametrize("mode", ["drop", "alter"])
def test_corrupted_scripts_score_zero(episodes, mode):
    """Zero from the checker: every call parsed and ran, every user turn was played."""
    run_ = episodes[mode]
    for task, gold, turns, tree in zip(episodes["tasks"], episodes["ground_truth"], run_["turns"], run_["trees"]):
        assert turns != gold and len(tree.leaves()) == 1
        nodes = leaf_path(tree)
        assert nodes[-1].reward == 0.0, task.task_id
        assert all("error" not in n.info for n in nodes)
        assert [n.info["tool_calls"][0] for n in nodes if n.kind == "tool"] == [
            {"name": c.name, "arguments": c.arguments} for cs in turns for c in cs
        ]
        assert sum(n.kind == "final" for n in nodes) == len(task.meta["entry"]["question"])
    assert run_["stats"].successes == 0 and run_["stats"].parse_errors == 0


def test_continuation_after_the_first_user_turn_scores_one(episodes):
    """`expand` restores the BFCL state kept at the first answer node (simulators + turn counter)."""
    gold = episodes["gold"]
    points, stats = gold["expanded"]
    for (ti, node_id, _), tree in zip(points, gold["trees"]):
        first, second = tree.leaves()
        d = tree.depth(node_id)
        assert tree.path(second)[d] == node_id and tree.path(second)[: d + 1] == tree.path(first)[: d + 1]
        assert len(tree.path(second)) == len(tree.path(first))
        assert tree.nodes[second].reward == 1.0
        assert tree.prefix_token_ids(second) == tree.prefix_token_ids(first)
    assert stats.successes == PER_CATEGORY and stats.parse_errors == 0


def test_a_ground_truth_call_the_parser_rejects_is_an_error_turn_and_the_episode_goes_on():
    """multi_turn_base_173 (a dataset quirk): `close_ticket` is called with a string `ticket_id` for an
    integer parameter. Through the loop the call is an error observation that runs nothing, the remaining
    user turns are still played, and the reward is 0."""
    env = BFCLMultiTurnEnv(categories=("base",))
    task = next(t for t in env.tasks("test") if t.task_id == "multi_turn_base_173")
    tok = qwen3_style_tokenizer()
    turns = ground_truth_calls(task)
    trees, stats, *_ = run(env, tok, [task], [ReactScaffold(tok).prompt_ids(task)], [script(tok, turns)])
    nodes = leaf_path(trees[0])
    errors = [n for n in nodes if n.kind == "error"]
    assert len(errors) == 1 and "bad arguments for tool 'close_ticket'" in errors[0].info["error"]
    assert errors[0].observation.startswith("Error: ") and "tool_calls" not in errors[0].info
    assert sum(n.kind == "final" for n in nodes) == len(task.meta["entry"]["question"])
    assert nodes[-1].reward == 0.0 and stats.parse_errors == 1


def _distinct_prompt_batches(tasks, prompts, size=25):
    batches = []
    for task, prompt in zip(tasks, prompts):
        for batch in batches:
            if len(batch) < size and all(p != prompt for _, p in batch):
                batch.append((task, prompt))
                break
        else:
            batches.append([(task, prompt)])
    return batches


@pytest.mark.skipif(not os.environ.get("BFCL_AGENT_LOOP_FULL"), reason="set BFCL_AGENT_LOOP_FULL=1 (2.5-4 min)")
@pytest.mark.parametrize("category", CATEGORIES)
def test_full_category_through_the_agent_loop(category):
    """Every task of the category, ground truth and both corruptions (the numbers in the module docstring)."""
    env = BFCLMultiTurnEnv(categories=(category,))
    tok = qwen3_style_tokenizer()
    tasks = env.tasks("test")
    scaffold = ReactScaffold(tok)
    gold = {t.task_id: ground_truth_calls(t) for t in tasks}
    batches = _distinct_prompt_batches(tasks, [scaffold.prompt_ids(t) for t in tasks])
    unexpected = {}
    for mode in ("gold", "drop", "alter"):
        want = 1.0 if mode == "gold" else 0.0
        bad = []
        for batch in batches:
            ts = [t for t, _ in batch]
            turns = [gold[t.task_id] if mode == "gold" else corrupt(gold[t.task_id], mode) for t in ts]
            trees, *_ = run(env, tok, ts, [p for _, p in batch], [script(tok, g) for g in turns])
            bad += [tr.prompt_id for tr in trees if leaf_path(tr)[-1].reward != want]
        unexpected[mode] = sorted(bad, key=lambda s: int(s.rsplit("_", 1)[1]))
    prefix = f"multi_turn_{category}_"
    assert unexpected["gold"] == sorted(
        (q for q in PARSER_QUIRKS if q.startswith(prefix)), key=lambda s: int(s.rsplit("_", 1)[1])
    )
    assert unexpected["drop"] == []
    assert {int(s.rsplit("_", 1)[1]) for s in unexpected["alter"]} <= ALTER_INVISIBLE
