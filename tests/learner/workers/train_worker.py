"""torchrun worker: train a tiny HF-initialised model on packed trees; write per-step metrics.

Usage: train_worker.py JOBS_JSON, a list of jobs run one after another in this process group:
  {"hf": DIR, "tp": N, "pp": N, "ep": N, "steps": N, "out": metrics.json,
   "ckpt": DIR, "save_at": K, "resume": bool, "nan_step": S}
Every step has 4 global micro-batches (packed trees, seed = 100*step + m);
DP rank r takes m = r, r + dp, ... so any layout sees the same global batch.
"""

import json
import math
import sys

import torch
import torch.distributed as dist
from common import next_token_loss, packed_tree
from megatron.core import parallel_state
from transformers import AutoConfig

from trace_mega.config import OptimConfig, ParallelConfig
from trace_mega.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trace_mega.learner.convert import load_hf_into
from trace_mega.learner.models import build_model, model_config_from_hf
from trace_mega.learner.optim import build_optimizer, train_step, wrap_ddp
from trace_mega.learner.parallel import destroy_parallel, init_parallel
from trace_mega.ops.attention import tree_attention_mask

MICRO_BATCHES = 4


def batches_for(step: int, dp_rank: int, dp_size: int) -> list[dict]:
    out = []
    for m in range(dp_rank, MICRO_BATCHES, dp_size):
        b = packed_tree(seed=100 * step + m)
        b["tree_mask"] = tree_attention_mask(b["token_node"], b["token_node_exit"])
        out.append(b)
    return out


def param_checksum(chunks) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in chunks[0].parameters():
        total += p.detach().double().abs().sum()
    dist.all_reduce(total)
    return float(total)


def run_job(job: dict) -> None:
    """One training run under its own parallel layout (the process group is reused)."""
    par = ParallelConfig(
        device="cpu",
        tensor_model_parallel_size=job.get("tp", 1),
        pipeline_model_parallel_size=job.get("pp", 1),
        expert_model_parallel_size=job.get("ep", 1),
        use_distributed_optimizer=True,
    )
    g = init_parallel(par, seed=0)
    mc = model_config_from_hf(AutoConfig.from_pretrained(job["hf"]), attention_backend="sdpa")
    net = build_model(mc, par, g.pgs, g.device, g.pp_rank, g.pp_size)
    load_hf_into(net, job["hf"], g)
    chunks = [wrap_ddp(net, par, g)]
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=3e-3, clip_grad_norm=1.0), par, g)
    start, records = 0, []
    if job.get("resume"):
        meta = load_checkpoint(latest_checkpoint(job["ckpt"]), chunks, optimizer, scheduler, g)
        start = meta["cursor"]
    for step in range(start, job["steps"]):
        loss_fn = next_token_loss
        if step == job.get("nan_step", -1):

            def loss_fn(out, batch):  # a poisoned micro-batch: NaN loss and gradients
                loss_sum, n, m = next_token_loss(out, batch)
                return loss_sum * float("nan"), n, m

        before = param_checksum(chunks)
        metrics = train_step(chunks, optimizer, scheduler, batches_for(step, g.dp_rank, g.dp_size), loss_fn, g)
        after = param_checksum(chunks)
        metrics.update(step=step, params_changed=float(before != after), params_finite=float(math.isfinite(after)))
        records.append(metrics)
        if step + 1 == job.get("save_at", -1):
            save_checkpoint(job["ckpt"], step + 1, chunks, optimizer, scheduler, g, {"cursor": step + 1})
    if g.rank == 0:
        with open(job["out"], "w") as f:
            json.dump({"dp_size": g.dp_size, "steps": records}, f, indent=1)
    parallel_state.destroy_model_parallel()


def main() -> None:
    jobs = json.loads(sys.argv[1])
    for job in jobs:
        run_job(job)
    destroy_parallel()


if __name__ == "__main__":
    main()
