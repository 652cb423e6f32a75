"""Resumable training checkpoints with megatron `dist_checkpointing`.

Layout under the checkpoint root:

    step_00000010/            one checkpoint (megatron dist_checkpointing dir)
        trainer_state.json    step, data cursor and any caller fields (JSON)
        rng/rank_00003.pt     this rank's torch + megatron-tracker RNG states and the caller's
                              per-rank state (`rank_state`: the predictor's replay window)
        manifest.json         every file above with its size (and sha256 when small), written last
    predictor_00000010.pt     files the caller saves beside the step (`extras`), in its manifest too
    latest                    text file: the name of the newest complete checkpoint

Model and optimizer state are sharded tensors (TP / PP / EP / DP layout
recorded by megatron), the LR scheduler a common (replicated) entry. Saving is
atomic: everything is written to `.tmp-step_XXXXXXXX`, the manifest last, then
the directory is renamed once all ranks finished, and only then is `latest`
replaced (os.replace), so a crash leaves the previous checkpoint as `latest`.
A write that fails on any rank (a full disk) fails the save on every rank with
one `CheckpointError`; the partial files are removed and `latest` is untouched.
After a save, rank 0 removes checkpoints beyond `keep_last` (milestones every
`keep_every` steps excepted). Resuming (`latest_checkpoint`) checks the newest
checkpoint against its manifest and falls back, with a warning naming the
broken file, to the newest intact one (docs/operations.md).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint.api import CheckpointException

from trace_mega.learner.models import unwrap
from trace_mega.learner.parallel import ParallelGroups

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "latest_checkpoint",
    "verify_checkpoint",
    "prune_checkpoints",
    "checkpoint_name",
    "trainer_state",
]

log = logging.getLogger(__name__)
_STATE_FILE = "trainer_state.json"
_MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")
# Files up to this size get a sha256 in the manifest (trainer state, megatron's metadata and
# common.pt, RNG states, the predictor); larger ones, the tensor shards, only their size:
# hashing them would read the whole checkpoint again at every save and resume.
_HASHED_MAX_BYTES = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, or a checkpoint root with none intact to resume from."""


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


def _describe(err: BaseException) -> str:
    """One line for a failed write: the underlying OSError when there is one (DCP and megatron wrap it)."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop(0)
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno is not None:
            return f"{type(e).__name__}: {e}"
        failures = getattr(e, "failures", None) or getattr(e, "_failures", None)  # DCP's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _agree(failure: Optional[BaseException], groups: ParallelGroups) -> Optional[str]:
    """The first failing rank's error as one line, on every rank (None when all succeeded). Collective."""
    error = None if failure is None else _describe(failure)
    if groups.world_size == 1:
        return error
    errors: list[Optional[str]] = [None] * groups.world_size
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def _file_entry(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    entry: dict[str, Any] = {"bytes": size}
    if size <= _HASHED_MAX_BYTES:
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entry


def _write_manifest(tmp: Path, step: int, extras: list[Path]) -> None:
    """`manifest.json` of the checkpoint being written in `tmp`: every file in it and the `extras`
    beside it, with sizes (and sha256 of the small ones). Written last: its presence means complete."""
    files = {p.relative_to(tmp).as_posix(): _file_entry(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"version": 1, "step": step, "files": files, "extras": {p.name: _file_entry(p) for p in extras}}
    (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _manifest_bytes(path: Path) -> int:
    """Total size of the checkpoint at `path` per its manifest (0 when it has none)."""
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
        return sum(e["bytes"] for part in ("files", "extras") for e in manifest[part].values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _space_problem(root: Path) -> Optional[str]:
    """Why the next checkpoint cannot fit (free space below the newest checkpoint's size), or None.

    Checked before writing because a write failing on rank 0 alone inside megatron's save
    (its common.pt and metadata) leaves the other ranks waiting in a collective."""
    newest = _newest_named(root)
    need = _manifest_bytes(newest) if newest is not None else 0
    if need == 0 or not root.exists():
        return None
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    gib = 2**30
    took = f"the last checkpoint took {need / gib:.2f} GiB"
    return f"{os.strerror(errno.ENOSPC)}: {free / gib:.2f} GiB free in {root}, {took}"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: Optional[OptimizerParamScheduler],
    groups: ParallelGroups,
    trainer_state: Optional[dict[str, Any]] = None,
    extras: Optional[Mapping[str, Callable[[Path], None]]] = None,
    keep_last: int = 0,
    keep_every: Optional[int] = None,
    rank_state: Any = None,
) -> Path:
    """Save model, optimizer, scheduler, RNG and `trainer_state` (JSON-able) at `step`. Collective.

    `rank_state`: anything picklable this rank needs back on resume (`load_checkpoint` returns it
    as `"rank_state"` when the world size is the same), saved with this rank's RNG states.

    `extras`: file name -> writer, files rank 0 writes beside the step directory (`root/name`;
    e.g. the trainer's predictor state), listed in the manifest and removed with the step.
    Then rank 0 removes older checkpoints (`prune_checkpoints(root, keep_last, keep_every)`).
    A write that fails on any rank raises `CheckpointError` on every rank, after rank 0 removed
    the partial files; the previous checkpoint stays `latest`.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    extra_paths = [root / name for name in (extras or {})]
    # Each phase ends in `_agree`, so that every rank learns of a failure on any rank and none waits
    # in a collective for a rank that gave up; this rank's own exception is kept as the cause.
    failure: Optional[BaseException] = None
    renamed = False
    if groups.rank == 0:
        try:
            problem = _space_problem(root)
            if problem is not None:
                failure = OSError(errno.ENOSPC, problem)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)  # empty: megatron warns of an "incomplete checkpoint" in a non-empty dir
        except OSError as err:
            failure = err
    error = _agree(failure, groups)
    if error is None:
        try:
            state = _sharded_state(chunks, optimizer, is_loading=False)
            if scheduler is not None:
                state["scheduler"] = scheduler.state_dict()
            dist_checkpointing.save(state, str(tmp), content_metadata=_CONTENT_METADATA)
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save({**_rng_state(), "rank_state": rank_state}, tmp / "rng" / f"rank_{groups.rank:05d}.pt")
            if groups.rank == 0:
                meta = {"step": step, "world_size": groups.world_size, **(trainer_state or {})}
                (tmp / _STATE_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
                for path, write in zip(extra_paths, (extras or {}).values()):
                    write(path)
        # Any failure, not only OSError (DCP's CheckpointException is even a BaseException): it is
        # raised again below, as CheckpointError with this as its cause.
        except (Exception, CheckpointException) as err:  # noqa: BLE001
            failure = err
        error = _agree(failure, groups)
    if error is None:
        if groups.rank == 0:
            try:
                _write_manifest(tmp, step, extra_paths)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                renamed = True
                latest_tmp = root / "latest.tmp"
                latest_tmp.write_text(final.name)
                os.replace(latest_tmp, root / "latest")
            except OSError as err:
                failure = err
        error = _agree(failure, groups)
    if error is not None:
        if groups.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if renamed:  # all or nothing: a complete step dir that `latest` could not be moved to goes too
                shutil.rmtree(final, ignore_errors=True)
            for path in extra_paths:
                path.unlink(missing_ok=True)
            (root / "latest.tmp").unlink(missing_ok=True)
            log.error("checkpoint %s not written (%s); `latest` still names %s", final, error, _named(root) or "none")
        raise CheckpointError(f"checkpoint {final} not written: {error}") from failure
    if groups.rank == 0:
        prune_checkpoints(root, keep_last, keep_every)
    dist.barrier()
    return final


def _named(root: Path) -> Optional[str]:
    """The checkpoint name `root/latest` holds, or None (no file, or not a step directory's name)."""
    try:
        name = (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.fullmatch(name) else None


def _step_of(path: Path) -> Optional[int]:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _step_dirs(root: Path) -> list[Path]:
    """The step directories under `root`, newest first."""
    dirs = [p for p in root.glob("step_*") if p.is_dir() and _step_of(p) is not None]
    return sorted(dirs, key=_step_of, reverse=True)


def _newest_named(root: Path) -> Optional[Path]:
    name = _named(root)
    return root / name if name else None


def verify_checkpoint(path: str | os.PathLike) -> Optional[str]:
    """What is wrong with the checkpoint at `path`, naming the file (None when it is intact).

    Checked against its manifest: every file present with its size, the small ones' sha256,
    and the `extras` beside it. A checkpoint without a manifest (written before they existed)
    counts as intact when its trainer_state.json reads as a JSON object.
    """
    path = Path(path)
    if not path.is_dir():
        return f"{path.name}: missing"
    if not (path / _MANIFEST).exists():
        try:
            state = json.loads((path / _STATE_FILE).read_text())
        except FileNotFoundError:
            return f"{path.name}/{_STATE_FILE}: missing (an unfinished save)"
        except (OSError, ValueError) as err:
            return f"{path.name}/{_STATE_FILE}: unreadable ({' '.join(str(err).split())})"
        return None if isinstance(state, dict) else f"{path.name}/{_STATE_FILE}: not a JSON object"
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
        parts = [(path, manifest["files"]), (path.parent, manifest["extras"])]
        if not all(isinstance(e.get("bytes"), int) for _, entries in parts for e in entries.values()):
            raise ValueError("an entry without a size")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{path.name}/{_MANIFEST}: unreadable ({' '.join(str(err).split())})"
    for base, entries in parts:
        for rel, entry in sorted(entries.items()):
            file = base / rel
            shown = file.relative_to(path.parent).as_posix()
            if not file.is_file():
                return f"{shown}: missing"
            size = file.stat().st_size
            if size != entry["bytes"]:
                return f"{shown}: {size} bytes, the manifest says {entry['bytes']}"
            if "sha256" in entry and hashlib.sha256(file.read_bytes()).hexdigest() != entry["sha256"]:
                return f"{shown}: contents differ from the manifest (sha256)"
    return None


def _resolve_latest(root: Path) -> Optional[Path]:
    """`latest_checkpoint` on one rank."""
    if not root.is_dir():
        return None
    named = _newest_named(root)
    candidates = ([named] if named is not None else []) + [p for p in _step_dirs(root) if p != named]
    if not candidates:
        return None
    if named is None:
        why = "does not name a checkpoint" if (root / "latest").exists() else "is missing"
        log.warning("%s %s; looking for the newest intact checkpoint", root / "latest", why)
    problems = []
    for path in candidates:
        problem = verify_checkpoint(path)
        if problem is None:
            if problems:
                log.warning("resuming from %s, the newest intact checkpoint in %s", path.name, root)
            if not (path / _MANIFEST).exists():
                log.warning("%s has no manifest (written before manifests existed): loading it unverified", path)
            return path
        problems.append(problem)
        log.warning("checkpoint %s is damaged or incomplete: %s; trying an older one", path, problem)
    raise CheckpointError(
        f"no intact checkpoint in {root} ({len(problems)} damaged; the newest: {problems[0]}); "
        "move them away or set checkpoint.resume: false to start afresh"
    )


def latest_checkpoint(root: str | os.PathLike, groups: Optional[ParallelGroups] = None) -> Optional[Path]:
    """The newest intact checkpoint under `root` (the one `latest` names, else the highest step
    dir; each checked with `verify_checkpoint`), or None when there is none at all.

    A damaged or incomplete one is skipped with a warning naming the broken file; when there are
    checkpoints but none is intact, raises `CheckpointError` naming `root`. With `groups` (and
    more than one rank) rank 0 decides and every rank gets its answer (collective).
    """
    root = Path(root)
    if groups is None or groups.world_size == 1:
        return _resolve_latest(root)
    found: list[Any] = [None]
    if groups.rank == 0:
        try:
            path = _resolve_latest(root)
            found[0] = ("ok", None if path is None else str(path))
        except CheckpointError as err:
            found[0] = ("error", str(err))
    dist.broadcast_object_list(found, src=0)
    kind, value = found[0]
    if kind == "error":
        raise CheckpointError(value)
    return None if value is None else Path(value)


def prune_checkpoints(root: str | os.PathLike, keep_last: int, keep_every: Optional[int] = None) -> list[Path]:
    """Remove older checkpoints once a new one is complete (rank 0 only); returns what was removed.

    Kept: the `keep_last` newest complete checkpoints up to the one `latest` names (0: all),
    milestones (step % keep_every == 0) and anything newer than `latest`'s. A removed step's
    extras (files beside it listed in its manifest, else `*_XXXXXXXX.pt` of its step) go too,
    and so do leftover `.tmp-step_*` directories of interrupted saves.
    """
    root = Path(root)
    newest = _newest_named(root)
    newest_step = _step_of(newest) if newest is not None else None
    if newest_step is None or not newest.is_dir():
        return []
    for tmp in root.glob(".tmp-step_*"):  # no save is under way: the caller's has completed
        shutil.rmtree(tmp, ignore_errors=True)
    if keep_last <= 0:
        return []
    complete = [
        p
        for p in _step_dirs(root)
        if _step_of(p) <= newest_step and ((p / _MANIFEST).exists() or (p / _STATE_FILE).exists())
    ]
    removed = []
    for path in complete[keep_last:]:
        step = _step_of(path)
        if path == newest or (keep_every and step % keep_every == 0):
            continue
        try:
            extras = list(json.loads((path / _MANIFEST).read_text())["extras"])
        except (OSError, ValueError, KeyError, TypeError):
            extras = [p.name for p in root.glob(f"*_{step:08d}.pt")]
        try:
            shutil.rmtree(path)
            for name in extras:
                if "/" not in name:  # only files beside the step dirs, whatever the manifest says
                    (root / name).unlink(missing_ok=True)
        except OSError as err:  # a leftover costs disk, not progress: warn and go on training
            log.warning("could not remove old checkpoint %s: %s", path, err)
            continue
        removed.append(path)
    if removed:
        log.info("removed old checkpoints %s (checkpoint.keep_last=%d)", ", ".join(p.name for p in removed), keep_last)
    return removed


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

    RNG states are restored, and the saved `rank_state` returned under `"rank_state"`, when the world
    size matches the saving run's (they are per rank; else `"rank_state"` is None); a different
    parallel layout still restores model, optimizer and scheduler (megatron reshards them).
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
    meta["rank_state"] = None
    if meta["world_size"] == groups.world_size and rng_file.exists():
        rank = torch.load(rng_file, weights_only=False)
        _set_rng_state(rank)
        meta["rank_state"] = rank.get("rank_state")  # files of older checkpoints have none
    return meta
