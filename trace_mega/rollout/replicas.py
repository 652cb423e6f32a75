"""Rollout replicas: which rank generates what, and how the step's trees meet again.

Layout (docs/design.md §6, distribution): the ranks of one model-parallel
group of the learner (TP x PP, as megatron lays them out) form one rollout
replica, so there are as many replicas as data-parallel ranks
(`rollout.tensor_parallel_size` may make a replica span several of them:
consecutive ranks, PP = 1). The replica's first rank is its *leader*: it hosts the in-process
torch engine and runs the replica's environment episodes (a vLLM replica runs
the engine on every rank of the group, `external_launcher`, and every rank
runs the same episodes; the leader's trees are the replica's).

A step's prompts are dealt to replicas by `assign_prompts`: a pure function of
the per-prompt work (rollouts planned for it), so every rank computes the same
assignment with no communication. After each phase (bare rollouts,
continuations) `exchange` all-gathers the leaders' new trees with one
`all_gather_object` over the world, so every rank holds the step's full trees
and takes the (global) allocation decisions identically; each rank keeps its
own tree objects (they carry the environment states continuations branch
from). The same gather carries every rank's error, if any, so a failing
episode on one replica fails the step on every rank with that rank named,
instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist

from trace_mega.rollout.tree import RolloutTree

__all__ = [
    "ReplicaLayout",
    "ReplicaError",
    "ReplicaAdmission",
    "replica_admission",
    "assign_prompts",
    "exchange",
    "stats_delta",
]


class ReplicaError(RuntimeError):
    """An episode, environment or engine failure on some replica (raised on every rank)."""


@dataclass(frozen=True)
class ReplicaLayout:
    """This rank's rollout replica."""

    replica: int
    """Replica id (the learner's data-parallel rank)."""
    num_replicas: int
    """Replicas in the run (the data-parallel size)."""
    leader: bool
    """This rank is its replica's first rank: it hosts the torch engine and its trees are the replica's."""
    rank: int = 0
    """Global rank (named in failure messages)."""

    @classmethod
    def single(cls) -> "ReplicaLayout":
        """One process, one replica."""
        return cls(0, 1, True, 0)

    @classmethod
    def from_groups(cls, g: Any, size: Optional[int] = None, engine: str = "torch") -> "ReplicaLayout":
        """From the learner's `ParallelGroups`: replicas of `size` ranks (default TP x PP, i.e. one
        per data-parallel rank) running `engine`. With PP = 1 megatron's TP groups are runs of
        consecutive ranks, so a replica is `size` consecutive ranks, `size` a multiple of TP (a
        replica never splits a TP group; `rollout.tensor_parallel_size` may span several learner DP
        ranks)."""
        mp = g.tp_size * g.pp_size
        size = mp if size is None else int(size)
        if g.pp_size > 1:
            if size != mp:
                raise ValueError(
                    f"rollout.tensor_parallel_size {size} with pipeline stages: a replica is one "
                    f"model-parallel group (TP x PP = {mp})"
                )
            if engine == "vllm" and g.dp_size > 1:
                # megatron orders PP outermost, so a replica's ranks are not consecutive; vLLM's
                # external launcher groups consecutive ranks into its tensor-parallel group.
                raise ValueError(
                    "rollout.engine vllm with parallel.pipeline_model_parallel_size > 1 runs one replica "
                    f"only (here {g.dp_size}): use PP = 1 with DP replicas, or the torch engine"
                )
            return cls(g.dp_rank, g.dp_size, g.tp_rank == 0 and g.pp_rank == 0, g.rank)
        if size % g.tp_size or g.world_size % size:
            raise ValueError(
                f"rollout.tensor_parallel_size {size} must be a multiple of the learner's TP "
                f"{g.tp_size} and divide the world size {g.world_size}"
            )
        return cls(g.rank // size, g.world_size // size, g.rank % size == 0, g.rank)

    @classmethod
    def from_world(cls) -> "ReplicaLayout":
        """Every rank of the default process group its own replica (no model parallelism)."""
        if not dist.is_initialized():
            return cls.single()
        r = dist.get_rank()
        return cls(r, dist.get_world_size(), True, r)


class ReplicaAdmission:
    """The replica leader's engine admissions, followed by the replica's other ranks.

    A replica whose every rank runs the engine (vLLM tensor parallel, `external_launcher`) needs
    the same requests in the same order on every rank; with per-episode scheduling, when an
    episode is ready depends on its tools' timing, which differs between ranks. So before each
    engine step the leader broadcasts the request ids it submits (None: the call is over) and
    the others submit exactly those (`AgentLoop._admissions`), never by their own timing.
    """

    def __init__(self, group: Any, leader_rank: int, leader: bool) -> None:
        self.group, self.leader_rank, self.leader = group, leader_rank, leader

    def agree(self, ids: Optional[list[int]]) -> Optional[list[int]]:
        """The leader's `ids` on every rank of the replica (a small object broadcast)."""
        box = [ids if self.leader else None]
        dist.broadcast_object_list(box, src=self.leader_rank, group=self.group)
        return box[0]


def replica_admission(layout: ReplicaLayout, runs_engine: bool) -> Optional[ReplicaAdmission]:
    """This rank's `ReplicaAdmission` when some replica's non-leader ranks also run an engine, else
    None. Collective over the world (every rank calls it): the ranks agree whether any follower runs
    an engine, then build one gloo group per replica (consecutive ranks, as vLLM's external launcher
    groups them)."""
    if not dist.is_initialized() or dist.get_world_size() == layout.num_replicas:
        return None  # one rank per replica: nothing to follow
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(runs_engine and not layout.leader))
    if not any(flags):
        return None
    size = dist.get_world_size() // layout.num_replicas
    mine = None
    for r in range(layout.num_replicas):  # new_group is collective: every rank makes every group
        group = dist.new_group(list(range(r * size, (r + 1) * size)), backend="gloo")
        if r == layout.replica:
            mine = ReplicaAdmission(group, r * size, layout.leader)
    return mine


def assign_prompts(work: Sequence[int], num_replicas: int) -> list[int]:
    """Replica of each prompt, balanced by `work` (e.g. rollouts planned for it), deterministically.

    Largest work first onto the least-loaded replica (ties: the lower prompt index, the lower
    replica), so the result depends only on `work` and the replica count. Prompts with no work
    go nowhere (-1): a replica may end up with none, which is fine.
    """
    owner, load = [-1] * len(work), [0] * max(num_replicas, 1)
    for i in sorted(range(len(work)), key=lambda i: (-int(work[i]), i)):
        if int(work[i]) <= 0:
            continue
        r = min(range(len(load)), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += int(work[i])
    return owner


def exchange(
    layout: ReplicaLayout,
    trees: Sequence[RolloutTree],
    mine: dict[int, RolloutTree],
    stats: dict[str, float],
    error: Optional[str],
) -> tuple[list[RolloutTree], list[dict[str, float]]]:
    """The step's trees after a phase, on every rank, and every replica's `stats` (by replica id).

    `trees` is the step's list before the phase (what a rank has for trees nobody changed),
    `mine` the trees this rank's replica produced (index in `trees` -> tree; ignored off the
    leader). A non-None `error` on any rank raises `ReplicaError` on every rank, naming it.
    """
    payload = {
        "rank": layout.rank,
        "replica": layout.replica,
        "leader": layout.leader,
        "error": error,
        "stats": stats,
        "trees": {i: t.to_dict() for i, t in mine.items()} if layout.leader and error is None else {},
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, payload)
    else:
        gathered = [payload]
    failed = [p for p in gathered if p["error"] is not None]
    if failed:
        raise ReplicaError(
            "rollout failed on " + "; ".join(f"rank {p['rank']} (replica {p['replica']}): {p['error']}" for p in failed)
        )
    out = list(trees)
    per_replica: list[dict[str, float]] = [{} for _ in range(layout.num_replicas)]
    for p in gathered:
        if not p["leader"]:
            continue
        per_replica[p["replica"]] = p["stats"]
        for i, d in p["trees"].items():
            out[i] = mine[i] if i in mine and p["replica"] == layout.replica else RolloutTree.from_dict(d)
    return out, per_replica


def stats_delta(now: Any, before: Any) -> dict[str, float]:
    """Counters of a `RolloutStats` accumulated since `before` (a copy taken earlier)."""
    a, b = dataclasses.asdict(now), dataclasses.asdict(before)
    return {k: a[k] - b[k] for k in a}
