"""Parallel state from torchrun's environment, with the process groups passed explicitly.

`init_parallel(cfg)` reads RANK / WORLD_SIZE / LOCAL_RANK (a single process
without torchrun is world size 1), starts torch.distributed (gloo on CPU, nccl
on GPU), turns on the CPU compatibility layer when the device is CPU, calls
megatron's `initialize_model_parallel(tp, pp, ep)` and seeds megatron's RNG
tracker. It returns a `ParallelGroups`: the ranks/sizes and megatron's
`ProcessGroupCollection`, which the model, optimizer and step code receive as
an argument instead of reading globals.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from trace_mega.config import ParallelConfig
from trace_mega.learner.cpu_compat import enable_cpu_compat

__all__ = ["ParallelGroups", "init_parallel", "destroy_parallel", "resolve_device", "free_port"]


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the TP x PP x DP (x EP) grid and its process groups."""

    device: torch.device
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    pgs: ProcessGroupCollection
    """megatron's collection (tp, pp, dp, dp_cp, ep, expt_tp, expt_dp, embd, ...)."""

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def free_port() -> int:
    """A TCP port that is free right now (for single-process runs and test launchers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(cfg: ParallelConfig, seed: int = 0) -> ParallelGroups:
    """Start distributed + megatron model parallelism from the torchrun environment."""
    device = resolve_device(cfg.device)
    enable_cpu_compat(device)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        if world_size == 1 and "MASTER_PORT" not in os.environ:
            # A lone process (no torchrun): its own free port, passed directly rather than through
            # os.environ, which every subprocess it starts would inherit (and collide on).
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    tp, pp, ep = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.expert_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not a multiple of TP*PP = {tp * pp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # Experts are sharded by EP only (models.transformer_config does the same).
        expert_tensor_parallel_size=1,
    )
    # Different TP ranks need different streams for TP-region dropout, the
    # same EP-rank streams for experts: megatron's tracker does this bookkeeping.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelGroups(
        device=device,
        rank=rank,
        world_size=world_size,
        tp_rank=pgs.tp.rank(),
        tp_size=pgs.tp.size(),
        pp_rank=pgs.pp.rank(),
        pp_size=pgs.pp.size(),
        dp_rank=pgs.dp.rank(),
        dp_size=pgs.dp.size(),
        ep_rank=pgs.ep.rank(),
        ep_size=pgs.ep.size(),
        pgs=pgs,
    )


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and every process group, in an order that lets each rank
    exit cleanly (docs/operations.md "Clean exits"); call it before the process exits.

    At a normal end (no exception on its way out of the caller, so every rank gets here) a barrier
    comes first: no rank closes its connections, and rank 0 the rendezvous store, while a peer is
    still in a collective. With an exception in flight there is no collective: the peers may never
    come. Last, a garbage collection frees process-group and work objects held in reference cycles
    now, while the interpreter is whole, not during its finalization, where a native thread they
    own that is still joinable aborts the process ("terminate called without an active exception").
    """
    if dist.is_initialized():
        if dist.get_world_size() > 1 and sys.exc_info()[1] is None:
            dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    else:
        parallel_state.destroy_model_parallel()
    gc.collect()
