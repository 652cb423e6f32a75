"""torchrun worker (DP=2): a checkpoint write failing on one rank, retention, and resuming past a damaged one.

Usage: checkpoint_worker.py HF_DIR CKPT_DIR OUT_PREFIX; writes OUT_PREFIX_<rank>.json with what each rank saw.
"""

import errno
import json
import os
import sys

import torch
import torch.distributed as dist
from common import next_token_loss, packed_tree
from transformers import AutoConfig

from trace_mega.config import OptimConfig, ParallelConfig
from trace_mega.learner.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from trace_mega.learner.convert import load_hf_into
from trace_mega.learner.models import build_model, model_config_from_hf
from trace_mega.learner.optim import build_optimizer, train_step, wrap_ddp
from trace_mega.learner.parallel import destroy_parallel, init_parallel
from trace_mega.ops.attention import tree_attention_mask


def main() -> None:
    hf, root, out = sys.argv[1:4]
    par = ParallelConfig(device="cpu", use_distributed_optimizer=True)
    g = init_parallel(par, seed=0)
    mc = model_config_from_hf(AutoConfig.from_pretrained(hf), attention_backend="sdpa")
    net = build_model(mc, par, g.pgs, g.device, g.pp_rank, g.pp_size)
    load_hf_into(net, hf, g)
    chunks = [wrap_ddp(net, par, g)]
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=3e-3), par, g)
    batch = packed_tree(seed=g.dp_rank)
    batch["tree_mask"] = tree_attention_mask(batch["token_node"], batch["token_node_exit"])
    train_step(chunks, optimizer, scheduler, [batch], next_token_loss, g)  # a stepped optimizer has state to save

    def save(step: int) -> None:
        extras = {f"predictor_{step:08d}.pt": lambda p: torch.save({"step": step}, p)}
        save_checkpoint(root, step, chunks, optimizer, scheduler, g, {"cursor": step}, extras, keep_last=2)

    result = {}
    save(1)
    save(2)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # rank 1's RNG file does not fit
        if g.rank == 1 and "/rng/rank_" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    torch.save = full_disk
    try:
        save(3)
    except CheckpointError as err:
        result["error"] = str(err)
    torch.save = real_save
    dist.barrier()
    result["after_failure"] = sorted(os.listdir(root))
    result["latest_after_failure"] = open(os.path.join(root, "latest")).read()
    dist.barrier()  # every rank has looked before rank 0 starts the next save (its .tmp- directory)
    save(4)  # keep_last=2: step 1 goes, with its predictor file
    result["after_prune"] = sorted(os.listdir(root))
    dist.barrier()
    if g.rank == 0:  # the newest checkpoint loses the end of its largest shard
        shard = max(
            (e for e in os.scandir(os.path.join(root, "step_00000004")) if e.is_file()), key=lambda e: e.stat().st_size
        )
        os.truncate(shard.path, shard.stat().st_size // 2)
    dist.barrier()
    path = latest_checkpoint(root, g)
    result["resumed_cursor"] = load_checkpoint(path, chunks, optimizer, scheduler, g)["cursor"]
    with open(f"{out}_{g.rank}.json", "w") as fh:
        json.dump(result, fh)
    destroy_parallel()


if __name__ == "__main__":
    main()
