"""Resumable training checkpoints with megatron `dist_checkpointing`.

Layout under the checkpoint root:

    step_00000010/            one checkpoint (megatron dist_checkpointing dir)
        trainer_state.json    step, data cursor and any caller fields (JSON)
        rng/rank_00003.pt     this rank's torch + megatron-tracker RNG states
    latest                    text file: the name of the newest complete checkpoint

Model and optimizer state are sharded tensors (TP / PP / EP / DP layout
recorded by megatron), the LR scheduler a common (replicated) entry. Saving is
atomic: everything is written to `.tmp-step_XXXXXXXX`, renamed once all ranks
finished, and only then is `latest` replaced (os.replace), so a crash leaves
the previous checkpoint as `latest`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from trace_mega.learner.models import unwrap
from trace_mega.learner.parallel import ParallelGroups

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "latest_checkpoint",
    "checkpoint_name",
    "trainer_state",
]

_STATE_FILE = "trainer_state.json"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint at `step`."""
    return f"step_{step:08d}"


# The distributed optimizer's state as one ShardedTensor per contiguous buffer
# (megatron-LM's default; fully parallel, reshardable over DP only). 0.16.1's
# own default, 'fully_sharded_model_space', fails with "ShardedTensor.flattened_range
# is not supported".
_CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def _sharded_state(chunks: list[torch.nn.Module], optimizer: MegatronOptimizer, is_loading: bool) -> dict:
    if len(chunks) != 1:
        raise ValueError("checkpointing supports one model chunk per rank (no virtual pipeline)")
    model_sd = unwrap(chunks[0]).sharded_state_dict(metadata=_CONTENT_METADATA)
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_CONTENT_METADATA),
    }


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    random.setstate(state["python"])


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: Optional[OptimizerParamScheduler],
    groups: ParallelGroups,
    trainer_state: Optional[dict[str, Any]] = None,
) -> Path:
    """Save model, optimizer, scheduler, RNG and `trainer_state` (JSON-able) at `step`. Collective."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if groups.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # empty: megatron warns of an "incomplete checkpoint" in a non-empty dir
    dist.barrier()
    state = _sharded_state(chunks, optimizer, is_loading=False)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(tmp), content_metadata=_CONTENT_METADATA)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{groups.rank:05d}.pt")
    if groups.rank == 0:
        meta = {"step": step, "world_size": groups.world_size, **(trainer_state or {})}
        (tmp / _STATE_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    dist.barrier()
    if groups.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
    dist.barrier()
    return final


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under `root` (per `latest`, else the highest step dir), or None."""
    root = Path(root)
    latest = root / "latest"
    if latest.exists():
        path = root / latest.read_text().strip()
        if (path / _STATE_FILE).exists():
            return path
    done = sorted(p for p in root.glob("step_*") if (p / _STATE_FILE).exists())
    return done[-1] if done else None


def trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """The `trainer_state.json` of the checkpoint at `path` (step, world size, the run's config, ...)."""
    return json.loads((Path(path) / _STATE_FILE).read_text())


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load only the model weights of the checkpoint at `path` into `model` (collective).

    The model may use another TP / EP layout than the saving run (megatron reshards the
    model's sharded tensors); optimizer state and RNG are left in the checkpoint.
    """
    net = unwrap(model)
    loaded = dist_checkpointing.load({"model": net.sharded_state_dict(metadata=_CONTENT_METADATA)}, str(path))
    with torch.no_grad():
        net.load_state_dict(loaded["model"])


def _load_request(chunks: list[torch.nn.Module], optimizer: MegatronOptimizer) -> dict:
    """The sharded state dict to load into, for a possibly never-stepped optimizer.

    Without Apex/TE, 0.16.1's `DistributedOptimizer.state_dict()` reads each
    Adam state's `step` and asserts on a fresh optimizer. So a fresh one gets
    megatron's own zero-gradient dummy step while the request is built, and
    that dummy state is dropped again, so that `load_state_dict` allocates the
    state itself and sets `step` from the checkpoint (it keeps an existing
    state's dummy step otherwise). The dummy step's change to the weights is
    overwritten by the model load.
    """
    primed = [o for o in _distributed(optimizer) if len(o.optimizer.state) == 0]
    for opt in primed:
        opt._init_optimizer_states_with_dummy_values()
    return _sharded_state(chunks, optimizer, is_loading=True)


def _distributed(optimizer: MegatronOptimizer) -> list[DistributedOptimizer]:
    opts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [o for o in opts if isinstance(o, DistributedOptimizer)]


def _restore_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Set every Adam state's `step` to its param group's restored `step`.

    0.16.1's `load_state_dict` restores the step count into the param groups,
    but then copies the load request's per-parameter `step` (the dummy step's)
    back over the states.
    """
    for opt in _distributed(optimizer):
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = opt.optimizer.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]))


def load_checkpoint(
    path: str | os.PathLike,
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: Optional[OptimizerParamScheduler],
    groups: ParallelGroups,
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` wrote; returns the trainer state (step, cursor, ...). Collective.

    RNG states are restored when the world size matches the saving run's
    (they are per rank); a different parallel layout still restores model,
    optimizer and scheduler (megatron reshards them).
    """
    path = Path(path)
    meta = json.loads((path / _STATE_FILE).read_text())
    state = _load_request(chunks, optimizer)
    # Non-sharded ("common") entries such as the scheduler come back as saved.
    loaded = dist_checkpointing.load(state, str(path))
    # In-place copies into (views of) parameters that require grad.
    with torch.no_grad():
        unwrap(chunks[0]).load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    rng_file = path / "rng" / f"rank_{groups.rank:05d}.pt"
    if meta["world_size"] == groups.world_size and rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta
