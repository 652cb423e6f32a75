"""Rollout replicas: the prompt assignment, replica-independent episodes, the tree exchange under
gloo (two processes), a replica without prompts, and a failure on one replica raised on every rank."""

import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scripted_engine import ScriptedEngine

from trace_mega.config import RolloutConfig
from trace_mega.envs.synthetic import ANSWER_DONE, MOVE_LEFT, MOVE_RIGHT, SyntheticToolsEnv
from trace_mega.learner.parallel import free_port
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.collector import RolloutCollector
from trace_mega.rollout.replicas import ReplicaError, ReplicaLayout, assign_prompts, exchange
from trace_mega.step import StepBatch

CFG = RolloutConfig(max_turns=4, max_new_tokens_per_turn=4, max_total_tokens=256)


def walker(tok):
    acts = [tok.convert_tokens_to_ids(a) for a in (MOVE_LEFT, MOVE_RIGHT, ANSWER_DONE)]
    return lambda prefix, rng: [rng.choice(acts)]


def test_assign_prompts_balances_work_deterministically():
    assert assign_prompts([4, 1, 3, 0, 2], 2) == [0, 0, 1, -1, 1]  # 4 | 3, then 2 onto 3, then 1 onto 4
    assert assign_prompts([2, 2, 2, 2], 2) == [0, 1, 0, 1]
    assert assign_prompts([5, 0, 0], 2) == [0, -1, -1]  # replica 1 gets nothing
    assert assign_prompts([1, 2, 3], 1) == [0, 0, 0]
    work = [3, 1, 4, 1, 5, 9, 2, 6]
    owner = assign_prompts(work, 3)
    loads = [sum(w for w, o in zip(work, owner) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(work) and owner == assign_prompts(list(work), 3)


def _trees_as_dicts(trees):
    """The trees' records without what measures the run rather than the episode (tool seconds, cache hits)."""
    out = [t.to_dict() for t in trees]
    for d in out:
        for n in d["nodes"]:
            n["info"] = {k: v for k, v in n["info"].items() if k not in ("tool_s", "cached_prefix_tokens")}
    return out


def test_episodes_do_not_depend_on_which_call_or_process_runs_them():
    """One call over 4 prompts == two calls over 2 prompts each (with the prompts' global keys),
    each on a fresh environment and engine, as two replicas would run them; same for continuations."""

    def loop():
        env = SyntheticToolsEnv(seed=5)
        return env, AgentLoop(env, ScriptedEngine(walker(env.tokenizer)), env.tokenizer, CFG)

    env, whole = loop()
    tasks, counts = env.tasks()[:4], [3, 1, 2, 2]
    ref = whole.rollout(tasks, counts, seed=11)
    points = [(t, n, 2) for t, tree in enumerate(ref) for n in range(1, len(tree)) if tree.nodes[n].reward is None][:5]
    whole.expand(ref, points, seed=12)
    parts = []
    for ids in ([2, 0], [3, 1]):  # another order, another grouping
        env, piece = loop()
        trees = piece.rollout([tasks[i] for i in ids], [counts[i] for i in ids], seed=11, keys=ids)
        local = {t: j for j, t in enumerate(ids)}
        piece.expand(trees, [(local[t], n, k) for t, n, k in points if t in local], seed=12)
        parts += list(zip(ids, trees))
    got = [t for _, t in sorted(parts, key=lambda p: p[0])]
    assert _trees_as_dicts(got) == _trees_as_dicts(ref)
    assert len({len(t) for t in ref}) > 1 and any(n.reward for t in ref for n in t.nodes)  # a non-trivial workload


def test_exchange_names_the_failing_rank():
    with pytest.raises(ReplicaError, match=r"rank 0 \(replica 0\): ValueError: boom"):
        exchange(ReplicaLayout.single(), [], {}, {}, "ValueError: boom")


class _FailingEngine(ScriptedEngine):
    def generate(self, prefixes, sampling):
        raise RuntimeError("engine fell over")


def _worker(rank: int, port: int, counts: list[int], fail_rank: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        env = SyntheticToolsEnv(seed=5)
        engine = (_FailingEngine if rank == fail_rank else ScriptedEngine)(walker(env.tokenizer))
        col = RolloutCollector(env, engine, env.tokenizer, CFG, tool_timeout_s=5.0, layout=ReplicaLayout.from_world())
        tasks = env.tasks()[: len(counts)]
        batch = StepBatch.from_prompts(0, tasks, col.prompt_ids(tasks))
        col.begin_step(0)
        try:
            grown = col.roll_out(tasks, batch.trees, counts, seed=3)
            batch.grow(grown, keep=[i for i, m in enumerate(counts) if m > 0])
            out[rank] = {
                "trees": _trees_as_dicts(batch.trees),
                "owner": col.tree_replica,
                "metrics": col.step_metrics(),
            }
        except ReplicaError as exc:
            out[rank] = {"error": str(exc)}
    except Exception:  # noqa: BLE001
        out[rank] = {"crash": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


def _spawn(counts, fail_rank=-1):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), counts, fail_rank, out), nprocs=2, start_method="spawn")
        return dict(out)


@pytest.mark.slow
def test_two_replicas_share_trees_and_a_failure_fails_every_rank():
    counts = [2, 0, 3, 1]
    res = _spawn(counts)
    assert "trees" in res[0] and "trees" in res[1], res
    assert res[0]["trees"] == res[1]["trees"] and res[0]["owner"] == res[1]["owner"] == [1, 0, 1]
    env = SyntheticToolsEnv(seed=5)
    ref = AgentLoop(env, ScriptedEngine(walker(env.tokenizer)), env.tokenizer, CFG).rollout(
        [env.tasks()[i] for i in (0, 2, 3)], [2, 3, 1], seed=3, keys=[0, 2, 3]
    )
    assert res[0]["trees"] == _trees_as_dicts(ref)  # one process rolling everything out: the same trees
    m = res[0]["metrics"]
    assert m["rollout/replicas_generating"] == 2 and m["rollout/replica_trajectories_min"] == 3
    assert m["rollout/replica_trajectories_max"] == 3 and m == res[1]["metrics"] | {
        k: v for k, v in m.items() if k.endswith("_s") or "seconds" in k
    }

    lonely = _spawn([5, 0, 0, 0])  # replica 1 gets no prompt: fine
    assert lonely[1]["metrics"]["rollout/replicas_generating"] == 1 and lonely[1]["owner"] == [0]

    failed = _spawn(counts, fail_rank=1)
    for r in (0, 1):
        assert "rank 1 (replica 1): RuntimeError: engine fell over" in failed[r].get("error", ""), failed


class _HangingEngine(ScriptedEngine):
    def generate(self, prefixes, sampling):
        time.sleep(60)  # far past the collective timeout: the peer must not wait for it
        return super().generate(prefixes, sampling)


def _hang_worker(rank: int, port: int, out: dict) -> None:
    """The trainer's process-group set-up (`init_parallel`, `parallel.collective_timeout_s` 5 s);
    rank 1's engine hangs inside the roll-out, rank 0 reaches the trees' gather without it."""
    from trace_mega.config import ParallelConfig
    from trace_mega.learner.parallel import destroy_parallel, init_parallel

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    init_parallel(ParallelConfig(device="cpu", collective_timeout_s=5.0), seed=0)
    env = SyntheticToolsEnv(seed=5)
    engine = (_HangingEngine if rank == 1 else ScriptedEngine)(walker(env.tokenizer))
    col = RolloutCollector(env, engine, env.tokenizer, CFG, tool_timeout_s=5.0, layout=ReplicaLayout.from_world())
    tasks = env.tasks()[:2]
    batch = StepBatch.from_prompts(0, tasks, col.prompt_ids(tasks))
    col.begin_step(0)
    start = time.monotonic()
    try:
        col.roll_out(tasks, batch.trees, [2, 2], seed=3)
        out[rank] = "returned"
    except Exception as exc:  # noqa: BLE001
        out[rank] = f"{type(exc).__name__} after {time.monotonic() - start:.0f} s: {exc}"
    if rank == 0:
        os._exit(0)  # the hung peer never joins a clean shutdown
    destroy_parallel()


@pytest.mark.slow
def test_a_hung_replica_fails_its_peers_gather_within_the_collective_timeout():
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.start_processes(_hang_worker, args=(free_port(), out), nprocs=2, start_method="spawn", join=False)
        ctx.processes[0].join(120)
        res = dict(out)
        for p in ctx.processes:
            p.kill()
    assert 0 in res and res[0] != "returned", res
    assert "timed out" in res[0].lower() or "timeout" in res[0].lower(), res[0]


def test_layout_from_the_learner_groups():
    from types import SimpleNamespace

    def g(rank, world, tp, pp=1):
        dp = world // (tp * pp)
        return SimpleNamespace(
            rank=rank,
            world_size=world,
            tp_size=tp,
            pp_size=pp,
            tp_rank=rank % tp,
            pp_rank=rank // (tp * dp),
            dp_rank=(rank // tp) % dp,
            dp_size=dp,
        )

    # TP 2 on 8 ranks: a replica per TP group (= per DP rank), led by its first rank.
    assert [ReplicaLayout.from_groups(g(r, 8, 2)).replica for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [ReplicaLayout.from_groups(g(r, 8, 2)).leader for r in range(4)] == [True, False, True, False]
    # rollout.tensor_parallel_size 4 over learner TP 2: one replica spans two DP ranks.
    four = [ReplicaLayout.from_groups(g(r, 8, 2), 4) for r in range(8)]
    assert [x.replica for x in four] == [0, 0, 0, 0, 1, 1, 1, 1] and four[0].num_replicas == 2
    # PP 2 x DP 2 (TP 1): stage-major ranks, a replica is {dp r on stage 0, dp r on stage 1}.
    pp = [ReplicaLayout.from_groups(g(r, 4, 1, pp=2)) for r in range(4)]
    assert [x.replica for x in pp] == [0, 1, 0, 1] and [x.leader for x in pp] == [True, True, False, False]
    with pytest.raises(ValueError, match="multiple of the learner's TP"):
        ReplicaLayout.from_groups(g(0, 8, 2), 3)
