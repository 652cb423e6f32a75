"""Per-episode scheduling: the request-level engine contract, tools off the critical path, and trees
that do not depend on when anything finished."""

import threading
import time

import pytest

from tests.rollout.scripted_engine import ScriptedEngine
from tests.rollout.test_agent_loop import cfg, icefree, open_nodes, oracle, tiny_policy
from trace_mega.envs.latency import ToolLatency
from trace_mega.envs.synthetic import SyntheticToolsEnv
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.engines import TorchEngine
from trace_mega.rollout.engines.base import SamplingParams


def comparable(trees):
    """Tree records without wall-clock fields; log-probs rounded (batched kernels round differently)."""
    out = [t.to_dict() for t in trees]
    for d in out:
        for n in d["nodes"]:
            n["info"].pop("tool_s", None)
            n["logprobs"] = [round(x, 4) for x in n["logprobs"]]
    return out


def test_requests_joining_mid_flight_finish_as_in_one_batch():
    env = SyntheticToolsEnv(seed=0)
    model = tiny_policy(len(env.tokenizer), env.tokenizer.eos_token_id)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [1, 2, 3, 4, 5, 6], [9, 8], [2, 2, 2, 2, 2]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=9, seeds=[11, 12, 13, 14, 15, 16])
    batched = TorchEngine(model).generate(prompts, sp)
    eng = TorchEngine(model, max_batch_size=3)
    one = lambda i: SamplingParams(temperature=1.0, max_new_tokens=9, seed=11 + i)  # noqa: E731
    got = {}
    for i in range(2):
        eng.submit(i, prompts[i], one(i))
    steps = 0
    while eng.in_flight() or len(got) < len(prompts):
        if steps == 2:  # later requests arrive while the first ones decode; one waits for a free slot
            for i in range(2, 6):
                eng.submit(i, prompts[i], one(i))
        got.update(eng.poll())
        steps += 1
    for i, comp in enumerate(batched):
        assert got[i].token_ids == comp.token_ids and got[i].finish_reason == comp.finish_reason
        assert got[i].logprobs == pytest.approx(comp.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="already in flight"):
        eng.submit(0, prompts[0], one(0))
        eng.submit(0, prompts[0], one(0))


def test_tool_latency_is_seeded_per_call():
    lat = ToolLatency(50.0, 1.0)
    draws = [lat.seconds(("call", i)) for i in range(400)]
    assert draws == [lat.seconds(("call", i)) for i in range(400)]
    assert sorted(draws)[200] == pytest.approx(0.05, rel=0.25)  # the median
    assert ToolLatency(50.0).seconds("x") == 0.05 and ToolLatency().seconds("x") == 0.0
    with pytest.raises(ValueError, match="tool_latency_ms"):
        ToolLatency(-1.0)


def _run(env, concurrency=None):
    model = tiny_policy(len(env.tokenizer), env.tokenizer.eos_token_id)
    loop = AgentLoop(
        env,
        TorchEngine(model),
        env.tokenizer,
        cfg(max_new_tokens_per_turn=4, max_turns=5, max_total_tokens=90),
        max_concurrent_tool_calls=concurrency,
    )
    trees = loop.rollout(env.tasks()[:5], [4, 0, 3, 4, 2], seed=3)
    picks = [(i, n, 2) for i, t in enumerate(trees) for n in open_nodes(t)[:2]]
    loop.expand(trees, picks, seed=4)
    loop.close()
    return trees, picks


def test_trees_do_not_depend_on_tool_latency_or_concurrency():
    """Same seeds: token-identical trees with instant tools, with seeded random latency (calls finishing
    in another order), and with one tool worker."""
    instant, picks = _run(SyntheticToolsEnv(seed=5))
    assert picks and sum(len(t.leaves()) for t in instant) > 13
    slow, _ = _run(SyntheticToolsEnv(seed=5, tool_latency_ms=4.0, tool_latency_sigma=1.0))
    serial, _ = _run(SyntheticToolsEnv(seed=5, tool_latency_ms=1.0, tool_latency_sigma=1.0), concurrency=1)
    assert comparable(slow) == comparable(instant)
    assert comparable(serial) == comparable(instant)


class _SlowTaskEnv(SyntheticToolsEnv):
    """The first tool call of the task starting at cell 0 blocks until released; others are instant."""

    def __init__(self):
        super().__init__(seed=0)
        self.release, self.blocked = threading.Event(), threading.Event()
        self.order: list[str] = []

    def step(self, state, call):
        if state.task.meta["start"] == 0 and not self.blocked.is_set():
            self.blocked.set()
            self.release.wait(30)
            self.order.append("slow call returned")
        else:
            self.order.append(f"{state.task.task_id} call")
        return super().step(state, call)


def test_an_episode_waiting_for_its_tool_holds_no_other_episode():
    env = _SlowTaskEnv()
    tok = env.tokenizer
    slow = next(t for t in icefree(env) if t.meta["start"] == 0 and t.meta["goal"] == 1)
    fast = next(t for t in icefree(env) if t.meta["start"] == 1 and t.meta["goal"] == 4)
    engine = ScriptedEngine(oracle(tok, thought=()))
    loop = AgentLoop(env, engine, tok, cfg(), tool_timeout_s=30)

    def free_slow_when_fast_done():  # the fast episode's 3 moves must happen while the slow call hangs
        while env.order.count(f"{fast.task_id} call") < 3:
            time.sleep(0.01)
        env.release.set()

    watcher = threading.Thread(target=free_slow_when_fast_done, daemon=True)
    watcher.start()
    try:
        trees = loop.rollout([slow, fast], [1, 1], seed=0)
    finally:
        env.release.set()
    assert env.order.index("slow call returned") == 3  # after all three of the fast episode's calls
    assert [t.nodes[t.leaves()[0]].reward for t in trees] == [1.0, 1.0]
    loop.close()


def test_a_hung_call_gives_its_worker_slot_back():
    """One tool worker, a call that never returns: after its turn's budget the other episodes go on."""
    env = _SlowTaskEnv()
    tok = env.tokenizer
    slow = next(t for t in icefree(env) if t.meta["start"] == 0 and t.meta["goal"] == 1)
    fast = next(t for t in icefree(env) if t.meta["start"] == 1 and t.meta["goal"] == 3)
    loop = AgentLoop(
        env, ScriptedEngine(oracle(tok, thought=())), tok, cfg(), tool_timeout_s=0.3, max_concurrent_tool_calls=1
    )
    try:
        trees = loop.rollout([slow, fast], [1, 2], seed=0)
    finally:
        env.release.set()
    hung = trees[0].nodes[trees[0].path(trees[0].leaves()[0])[1]]
    assert hung.info["tool_timeout"] and "timed out after 0.3 s" in hung.observation
    assert all(t.nodes[leaf].reward == 1.0 for t in trees for leaf in t.leaves())  # the slow one retried
    assert loop.last_stats.tool_timeouts == 1
    loop.close()


def test_phase_metrics():
    env = SyntheticToolsEnv(seed=0, tool_latency_ms=2.0)
    tok = env.tokenizer
    loop = AgentLoop(env, ScriptedEngine(oracle(tok, thought=())), tok, cfg())
    loop.rollout(icefree(env)[:6], [3] * 6, seed=0)
    st = loop.last_stats
    assert st.inflight_max == 18  # every episode's first turn at once
    assert st.tool_calls > 0 and st.tool_wait_s >= st.tool_calls * 0.002
    assert 0 < st.engine_busy_s <= st.phase_s and 0 <= st.tail_s <= st.phase_s
    loop.close()


def _follower_worker(rank: int, port: int, out: dict) -> None:
    import os

    import torch.distributed as dist

    from trace_mega.rollout.replicas import ReplicaLayout, replica_admission

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        layout = ReplicaLayout(0, 1, rank == 0, rank)  # one replica of two ranks, both running the engine
        admission = replica_admission(layout, runs_engine=True)
        # Different tool timings on the two ranks: the follower's tools are slow and random.
        env = SyntheticToolsEnv(seed=2, tool_latency_ms=3.0 * rank, tool_latency_sigma=1.0)
        engine = ScriptedEngine(oracle(env.tokenizer, thought=()))
        loop = AgentLoop(env, engine, env.tokenizer, cfg(), admission=admission)
        trees = loop.rollout(env.tasks()[:6], [3] * 6, seed=1)
        loop.expand(trees, [(i, open_nodes(t)[0], 2) for i, t in enumerate(trees) if open_nodes(t)], seed=2)
        loop.close()
        out[rank] = {"calls": [p for p, _ in engine.calls], "trees": comparable(trees)}
    finally:
        dist.destroy_process_group()


def test_a_multi_rank_replica_feeds_every_engine_the_leaders_requests():
    import torch.multiprocessing as mp

    from trace_mega.learner.parallel import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_follower_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
        res = dict(out)
    assert res[0]["calls"] == res[1]["calls"]  # the same requests, grouped into the same engine steps
    assert res[0]["trees"] == res[1]["trees"]
    env = SyntheticToolsEnv(seed=2)
    loop = AgentLoop(env, ScriptedEngine(oracle(env.tokenizer, thought=())), env.tokenizer, cfg())
    alone = loop.rollout(env.tasks()[:6], [3] * 6, seed=1)
    loop.expand(alone, [(i, open_nodes(t)[0], 2) for i, t in enumerate(alone) if open_nodes(t)], seed=2)
    assert comparable(alone) == res[0]["trees"]
