"""`dapo`: DAPO's dynamic sampling as an allocator, against an independent re-implementation of
verl's `filter_groups` loop, within the step's trajectory budget, and the same for any replica count.

The rounds run through the real `RolloutCollector` and `AgentLoop` on a scripted environment:
each prompt's rewards are fixed (all 0, all 1, or mixed), so every round's outcome is known.
"""

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trace_mega.allocation import DapoAllocator, build_allocator
from trace_mega.config import AllocationConfig, ConfigError, RolloutConfig
from trace_mega.envs.base import EpisodeState
from trace_mega.envs.synthetic import ANSWER_DONE, SyntheticEnv
from trace_mega.kernels._triton_env import env_without_interpreter
from trace_mega.learner.parallel import free_port
from trace_mega.rollout.collector import RolloutCollector, reward_spread
from trace_mega.rollout.engines.base import Completion, Engine, SamplingParams
from trace_mega.rollout.replicas import ReplicaLayout
from trace_mega.step import StepBatch

GROUP = 4
REWARDS = {"0": [0.0] * GROUP, "1": [1.0] * GROUP, "mix": [1.0, 0.0, 0.0, 1.0]}
"""A prompt's group rewards by its kind (a mixed group holds both outcomes in any order)."""


class ScriptedRewardEnv(SyntheticEnv):
    """`synthetic` whose reward is scripted per prompt: the k-th episode of prompt i to end gets
    `REWARDS[kinds[i]][k % GROUP]` (all of a prompt's episodes run in one process)."""

    def __init__(self, kinds: list[str]) -> None:
        super().__init__(num_tasks=len(kinds))
        self.kinds, self.ended = kinds, [0] * len(kinds)

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        i = int(state.task.task_id.rsplit("-", 1)[1])
        self.ended[i] += 1
        return REWARDS[self.kinds[i]][(self.ended[i] - 1) % GROUP]


class AnswerEngine(Engine):
    """Answers at once: every episode is one turn that ends with the answer token."""

    def __init__(self, done: int) -> None:
        super().__init__()
        self.done = done

    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        return [Completion(token_ids=[self.done], logprobs=[-0.1], finish_reason="stop") for _ in prefixes]

    def update_weights(self, named_tensors: Iterable) -> None:
        for _ in named_tensors:
            pass


def verl_filter_groups(
    stream: list[int], rewards: list[list[float]], gen_batch_size: int, train_batch_size: int, max_num_gen_batches: int
) -> tuple[list[int], int]:
    """verl's dynamic sampling, re-implemented from its definition (RayDAPOTrainer.fit in
    recipe/dapo/dapo_ray_trainer.py, volcengine/verl at 004c888001c88628b98fbc5fdee9c3e9b8898800):
    per gen batch (the next `gen_batch_size` prompts of the stream), keep the prompts whose rewards
    have np.std > 0 (or a single rollout), append their trajectories to the batch; with fewer than
    `train_batch_size` kept prompts, go on while num_gen_batches < max_num_gen_batches, else raise;
    once full, cut the trajectory batch to train_batch_size * n. Returns (the prompts of the cut
    batch in order, num_gen_batches)."""
    batch: list[tuple[int, float]] = []
    num_prompt_in_batch = num_gen_batches = 0
    for start in range(0, len(stream), gen_batch_size):
        num_gen_batches += 1
        gen = stream[start : start + gen_batch_size]
        kept = [p for p in gen if np.std(rewards[p]) > 0 or len(rewards[p]) == 1]
        num_prompt_in_batch += len(kept)
        batch += [(p, r) for p in kept for r in rewards[p]]
        if num_prompt_in_batch < train_batch_size:
            if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
                continue
            raise ValueError(f"{num_gen_batches=} >= {max_num_gen_batches=}")
        cut = batch[: train_batch_size * GROUP]
        return list(dict.fromkeys(p for p, _ in cut)), num_gen_batches
    raise StopIteration("the stream ran out")


def _collector(kinds: list[str], layout: Optional[ReplicaLayout] = None):
    env = ScriptedRewardEnv(kinds)
    done = env.tokenizer.convert_tokens_to_ids(ANSWER_DONE)
    cfg = RolloutConfig(max_turns=2, max_new_tokens_per_turn=4, max_total_tokens=256)
    return env, RolloutCollector(env, AnswerEngine(done), env.tokenizer, cfg, tool_timeout_s=5.0, layout=layout)


def _dapo(
    kinds: list[str], target: int, per_round: int, rounds_paid: int, extra: int = 0, min_trees: int = 1
) -> DapoAllocator:
    """A dapo allocator on a budget of `rounds_paid` full rounds (+ `extra` trajectories), as M roots, N = 0."""
    cfg = AllocationConfig(
        name="dapo",
        prompts_per_step=len(kinds),
        root_rollouts_per_step=rounds_paid * per_round * GROUP + extra,
        continuations_per_rollout=0.0,
        group_size=GROUP,
        dapo_target_groups=target,
        dapo_groups_per_round=per_round,
    )
    return build_allocator(cfg, min_trees=min_trees)


def _step(kinds: list[str], alloc: DapoAllocator, layout: Optional[ReplicaLayout] = None):
    """One step's bare rollouts in dapo's rounds; (batch after `grow`, m, keep, metrics)."""
    env, col = _collector(kinds, layout)
    tasks = env.tasks()
    batch = StepBatch.from_prompts(0, tasks, col.prompt_ids(tasks))
    col.begin_step(0)
    g = torch.Generator().manual_seed(0)
    m = alloc.plan_roots(torch.zeros(len(tasks), dtype=torch.float64), g)
    grown, m, keep = col.roll_out_rounds(tasks, batch.trees, m, alloc, seed=0, generator=g)
    batch.grow(grown, keep=keep)
    return batch, m, keep, alloc.metrics() | col.step_metrics()


CASES = {
    # kinds in stream order, target (train_batch_size), groups per round (gen_batch_size), rounds paid
    "fills_in_round_2_and_cuts_the_surplus": ("0 mix 1 mix mix mix 1 mix 0 mix".split(), 3, 3, 3),
    "fills_in_round_1": ("mix mix 0 mix 1 0".split(), 2, 3, 2),
    "fills_exactly_in_round_3": ("0 1 mix 0 mix mix 1 mix 0 0".split(), 3, 2, 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kept_groups_and_rounds_equal_verls_filter_groups(name):
    kinds, target, per_round, rounds_paid = CASES[name]
    rewards = [REWARDS[k] for k in kinds]
    want, gen_batches = verl_filter_groups(list(range(len(kinds))), rewards, per_round, target, rounds_paid)
    batch, m, keep, metrics = _step(kinds, _dapo(kinds, target, per_round, rounds_paid))
    assert keep == want
    assert [t.prompt_id for t in batch.trees] == [f"synthetic-{i}" for i in want]
    assert metrics["alloc/dapo_rounds"] == gen_batches and metrics["alloc/kept_groups"] == target
    # Every drawn prompt got one group; the rounds stopped there (fewer than the budget when full early).
    assert m.tolist() == [GROUP] * (gen_batches * per_round) + [0] * (len(kinds) - gen_batches * per_round)
    assert metrics["rollout/replica_trajectories_max"] == int(m.sum()) <= rounds_paid * per_round * GROUP
    assert all(len(t.leaves()) == GROUP for t in batch.trees) and bool((reward_spread(batch.trees) > 0).all())


def test_the_budget_ends_the_rounds_where_verl_raises_and_the_step_trains_on_what_it_kept():
    kinds = "0 mix 1 0 0 1 mix 0 0 mix 1 mix".split()
    rewards = [REWARDS[k] for k in kinds]
    with pytest.raises(ValueError, match="max_num_gen_batches"):  # verl: 3 gen batches, 2 of 4 prompts kept
        verl_filter_groups(list(range(len(kinds))), rewards, 3, 4, 3)
    batch, m, keep, metrics = _step(kinds, _dapo(kinds, 4, 3, 3))
    assert keep == [1, 6] and metrics["alloc/dapo_rounds"] == 3 and metrics["alloc/kept_groups"] == 2
    assert int(m.sum()) == 36 == metrics["rollout/replica_trajectories_max"]  # the whole budget, generated
    # A group and a half more: a 4th round cut to the one group the budget pays; half a group unspent.
    _, m, keep, metrics = _step(kinds, _dapo(kinds, 4, 3, 3, extra=GROUP + 2))
    assert metrics["alloc/dapo_rounds"] == 4 and m[9:].tolist() == [GROUP, 0, 0] and keep == [1, 6, 9]


def test_a_step_keeps_at_least_min_trees_groups_padding_with_uncontrasted_ones_in_draw_order():
    kinds = "0 1 0 1 0 1".split()  # no contrast at all: the learner still gets a tree
    batch, m, keep, metrics = _step(kinds, _dapo(kinds, 2, 2, 2))
    assert keep == [0] and metrics["alloc/kept_groups"] == 0 and metrics["alloc/dapo_rounds"] == 2
    kinds = "1 mix 0 0 1 1".split()  # one contrasted group, three trees for three data-parallel ranks
    batch, m, keep, metrics = _step(kinds, _dapo(kinds, 2, 3, 2, min_trees=3))
    assert keep == [0, 1, 2] and metrics["alloc/kept_groups"] == 1 and int(m.sum()) == 24
    assert [t.leaf_rewards() for t in batch.trees] == [REWARDS["1"], REWARDS["mix"], REWARDS["0"]]


def test_a_plan_that_could_leave_a_data_parallel_rank_without_a_tree_fails_at_construction():
    kinds = "1 mix 0 0 1 1".split()
    with pytest.raises(ValueError, match="only 2 prompts .* fewer than the 3 data-parallel ranks"):
        _dapo(kinds, 2, 2, 2, min_trees=3)  # a first round of 2 groups can reach the target of 2 and stop
    base = dict(prompts_per_step=64, root_rollouts_per_step=64, rollouts_per_prompt_max=8, group_size=4)
    for name, fewest in (("uniform", 32), ("pcl", 32), ("treepo", 16), ("trace", 8), ("trace_global", 8)):
        assert build_allocator(AllocationConfig(name=name, **base), min_trees=fewest).fewest_trees() == fewest
        with pytest.raises(ValueError, match=f"allocation.name={name}: a step may serve only {fewest} prompts"):
            build_allocator(AllocationConfig(name=name, **base), min_trees=fewest + 1)


@pytest.mark.parametrize("seed", range(40))
def test_random_scripts_never_exceed_the_budget_and_agree_with_verl(seed):
    """Allocator level (the spreads given directly): the same rounds as the collector runs them."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(4, 20))
    kinds = list(rng.choice(["0", "1", "mix"], size=B))
    target, per_round = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    rounds_paid, extra = int(rng.integers(1, 5)), int(rng.integers(0, 2 * GROUP))
    alloc = _dapo(kinds, target, per_round, rounds_paid, extra)
    spread = torch.tensor([0.0 if k != "mix" else 1.0 for k in kinds], dtype=torch.float64)
    m = alloc.plan_roots(torch.zeros(B, dtype=torch.float64))
    while int(m.sum()) and int((new := alloc.plan_refill(m, spread)).sum()):
        assert not bool(((new > 0) & (m > 0)).any())  # fresh prompts only
        m = m + new
    assert int(m.sum()) <= alloc.trajectories_per_step and bool(((m == 0) | (m == GROUP)).all())
    keep = torch.nonzero(alloc.plan_keep(m, spread)).flatten().tolist()
    try:
        want, gen_batches = verl_filter_groups(list(range(B)), [REWARDS[k] for k in kinds], per_round, target, 0)
    except StopIteration:  # the stream ran out before the batch filled
        want, gen_batches = None, None
    paid = min(B, alloc.trajectories_per_step // GROUP)  # groups the budget and the candidates allow
    contrasted = [i for i in range(B) if kinds[i] == "mix"]
    if want is not None and min(gen_batches * per_round, B) <= paid:  # verl fills within dapo's budget
        assert keep == want and alloc.metrics()["alloc/dapo_rounds"] == gen_batches
    else:  # the budget (or the stream) ends first: the contrasted groups among the paid ones, cut to the target
        drawn = [i for i in contrasted if i < paid][:target]
        assert int(m.sum()) == paid * GROUP and keep == (drawn or [0])  # none: the first group drawn


def test_defaults_and_config_checks():
    alloc = build_allocator(AllocationConfig(name="dapo", prompts_per_step=32, root_rollouts_per_step=32))
    assert (alloc.group_budget, alloc.target, alloc.per_round) == (16, 16, 16)  # 64 trajectories / 4
    assert not alloc.uses_predictor and not alloc.tree and alloc.without_predictor() is alloc
    for field in ("dapo_target_groups", "dapo_groups_per_round"):
        with pytest.raises(ConfigError, match=f"^{field}: must be >= 1"):
            AllocationConfig(name="dapo", **{field: 0}).validate()


def _dp_worker(rank: int, port: int, kinds: list[str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        batch, m, keep, metrics = _step(kinds, _dapo(kinds, 3, 3, 3), ReplicaLayout.from_world())
        trees = [(t.prompt_id, t.leaf_rewards()) for t in batch.trees]
        out[rank] = {
            "trees": trees,
            "m": m.tolist(),
            "keep": keep,
            "rounds": metrics["alloc/dapo_rounds"],
            "generating": metrics["rollout/replicas_generating"],
        }
    except Exception:  # noqa: BLE001
        out[rank] = {"crash": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_replicas_keep_the_same_batch_as_one():
    kinds = CASES["fills_in_round_2_and_cuts_the_surplus"][0]
    batch, m, keep, metrics = _step(kinds, _dapo(kinds, 3, 3, 3))
    one = {"trees": [(t.prompt_id, t.leaf_rewards()) for t in batch.trees], "m": m.tolist(), "keep": keep}
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_dp_worker, args=(free_port(), kinds, out), nprocs=2, start_method="spawn")
        res = dict(out)
    for r in (0, 1):
        assert "crash" not in res[r], res[r]
        assert {k: res[r][k] for k in one} == one and res[r]["rounds"] == metrics["alloc/dapo_rounds"] == 2
        assert res[r]["generating"] == 2  # both replicas rolled out a share


# --- in the trainer -------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
# The demo's tiny CPU config, shrunk; the `synthetic` env pays the random policy from step 0, so
# some groups are contrasted and some are not. 24 trajectories: 6 groups of 4, 2 per round.
TRAIN = [
    "allocation.name=dapo",
    "allocation.prompts_per_step=8",
    "allocation.root_rollouts_per_step=12",
    "allocation.dapo_groups_per_round=2",
    "allocation.dapo_target_groups=3",
    "rollout.max_turns=4",
    "env.name=synthetic",
    "env.options={num_tasks: 16}",
    "telemetry.tensorboard=false",
    "telemetry.progress_bars=false",
    "steps=3",
]


def _train(out: Path, *launcher: str) -> list[dict]:
    """The metrics rows of a `trace-mega train` run of `TRAIN` (under `launcher`, e.g. torchrun)."""
    cmd = [*launcher, "-m", "trace_mega", "train", "--config", str(ROOT / "configs" / "demo_cpu.yaml")]
    cmd += [*TRAIN, f"telemetry.out_dir={out}"]
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_rows(rows: list[dict], min_trees: int) -> None:
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        generated, kept = r["alloc/generated_trajectories"], r["alloc/kept_groups"]
        assert generated == 24 - r["alloc/budget_unspent"] and generated % 4 == 0 and r["loss/skipped"] == 0.0
        assert 1 <= r["alloc/dapo_rounds"] == generated / 8 and 0 <= kept <= 3 and r["rollout/generated_tokens"] > 0
        # The step trains on the contrasted groups it kept, padded to `min_trees` with uncontrasted ones.
        assert r["alloc/contrasted_prompts"] == kept and r["alloc/active_prompts"] == max(kept, min_trees)
        assert r["alloc/trajectories"] == 4 * r["alloc/active_prompts"]
        assert kept == 3 or generated == 24  # the rounds end at the target or at the budget
    assert any(r["alloc/dapo_rounds"] > 1 for r in rows) and any(r["alloc/kept_groups"] for r in rows)


@pytest.mark.slow
def test_dapo_trains_end_to_end_within_the_budget(tmp_path):
    _check_rows(_train(tmp_path, sys.executable), min_trees=1)


@pytest.mark.slow
def test_dapo_in_the_trainer_dp2_logs_what_dp1_logs(tmp_path):
    one = _train(tmp_path / "dp1", sys.executable)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    two = _train(tmp_path / "dp2", *torchrun, "--master-port", str(free_port()))
    _check_rows(two, min_trees=2)
    assert all(b["rollout/replicas_generating"] == 2 for b in two)
    rounds = ("alloc/generated_trajectories", "alloc/dapo_rounds", "alloc/kept_groups", "rollout/generated_tokens")
    exact = ("alloc/", "reward/", "data/", "rollout/generated_tokens", "loss/units")
    for a, b in zip(one, two):
        assert {k: a[k] for k in rounds} == {k: b[k] for k in rounds}  # the same rounds, the same groups kept
        if a["alloc/kept_groups"] < 2:  # DP=2 pads the batch to a tree per rank: the updates differ from here
            break
        assert {k: v for k, v in a.items() if k.startswith(exact)} == {
            k: v for k, v in b.items() if k.startswith(exact)
        }
