"""Weight sync from the Megatron learner into the rollout engines: seconds and bytes per rank.

Measured (CPU, gloo, torchrun): a tiny policy at learner TP = 1 and TP = 2, one
torch engine on every rank (one engine per rank is the colocated layout), the
trainer's path: `Learner.export_weights()` (full HF tensors, gathered over
TP/EP: collective) streamed into `Engine.update_weights`. Per rank: seconds of
the export (gathers) and of the engine load, bytes received from peers
(exported bytes minus the rank's own shard bytes) and bytes handed to the
engine. Median of `--reps` after one warm-up.

Projected (H100, no run): the same quantities for Qwen3-14B and Qwen3-30B-A3B
under their shipped configs, from the parameter counts and layouts of
`trace-mega plan`, for two paths:

* `gather`: today's export — every rank all-gathers every TP/EP-sharded tensor
  and hands full tensors to its engine, which keeps its own slice;
* `aligned`: each rank hands its engine only the slice that engine loads; with
  rollout TP a multiple of learner TP the dense slices are local, and a
  replica's experts are gathered only within the replica.

Assumptions (printed with the table): bf16 weights; NVLink all-gather bus
bandwidth `--nvlink-gbps` (default 360 GB/s, NCCL's typical H100 figure),
inter-node `--ib-gbps` (default 45 GB/s per GPU, 400 Gb/s NDR); HBM copy
bandwidth `--hbm-gbps` (default 1500 GB/s); tensors synced in buckets of
`--bucket-mib` (default 512 MiB) with `--latency-us` (default 30 us) per
collective; the engine's per-tensor load cost `--engine-us-per-tensor`
(default 50 us: weight loaders run once per HF tensor, and an MoE checkpoint
has three tensors per expert per layer — an assumption, not measured on a
GPU; the CPU run prints the torch engine's own figure). Anchor: NeMo-RL
reports 0.74-1.0 s refit for Qwen3-30B-A3B.

    python benchmarks/bench_weight_sync.py [--reps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import RESULTS, ROOT, command_line, parser, print_table, write_json

GB = 1e9


def _worker(out: str, reps: int, model: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from trace_mega.config import TrainConfig, load_yaml
    from trace_mega.learner.hf_files import hf_config
    from trace_mega.learner.learner import Learner
    from trace_mega.rollout.engines import TorchEngine

    tp = int(os.environ["WORLD_SIZE"])
    cfg = load_yaml(
        TrainConfig,
        ROOT / "configs" / "demo_cpu.yaml",
        ["parallel.device=cpu", f"parallel.tensor_model_parallel_size={tp}", *model],
    )
    learner = Learner(cfg)
    engine = TorchEngine(hf_config(learner.model_cfg), device=torch.device("cpu"), enable_prefix_caching=False)
    local_bytes = sum(p.numel() * p.element_size() for p in learner.policy.parameters())
    export_s, load_s, exported = [], [], 0
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        named = list(learner.export_weights())
        t1 = time.perf_counter()
        engine.update_weights(named)
        t2 = time.perf_counter()
        export_s.append(t1 - t0)
        load_s.append(t2 - t1)
        exported = sum(t.numel() * t.element_size() for _, t in named)
    row = dict(
        rank=dist.get_rank(),
        tp=tp,
        export_s=statistics.median(export_s[1:]),
        load_s=statistics.median(load_s[1:]),
        bytes_received=exported - local_bytes,
        bytes_to_engine=exported,
        tensors=len(named),
        params=sum(p.numel() for p in engine.model.parameters()),
    )
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(row))


def _measure(tp: int, reps: int, model: list[str]) -> list[dict]:
    from trace_mega.learner.parallel import free_port

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(tp),
            f"--master-port={free_port()}",
            __file__,
            "--worker",
            tmp,
            "--reps",
            str(reps),
            *sum((["--model", m] for m in model), []),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"torchrun TP={tp} failed:\n{proc.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]


def project(config: str, a: argparse.Namespace) -> dict:
    """Seconds per rank of the `gather` and `aligned` sync paths for a shipped config (see the module doc)."""
    from trace_mega.commands.plan import count_params, model_for_plan, plan_memory
    from trace_mega.config import TrainConfig, load_yaml

    cfg = load_yaml(TrainConfig, ROOT / "configs" / config, [])
    m = model_for_plan(cfg)
    plan = plan_memory(cfg, model=m)
    c = count_params(m)
    lay, wb = plan.layout, 2
    tp, ep, rtp = lay["tp"], lay["ep"], lay["rollout_tp"]
    dense = (c.total - c.num_layers * c.layer_experts) * wb
    experts = c.num_layers * c.layer_experts * wb
    nvlink, ib, hbm = a.nvlink_gbps * GB, a.ib_gbps * GB, a.hbm_gbps * GB
    per_node = cfg.cluster.gpus_per_node
    ep_bw = nvlink if ep <= per_node else ib  # an EP group spanning nodes is bound by the inter-node link

    per_layer = 9 + 3 * m.num_experts if m.num_experts else 11  # HF tensors: attention, norms, router / MLP
    tensors = c.num_layers * (per_layer + (3 if m.qkv_bias else 0)) + 2 + (0 if m.tie_word_embeddings else 1)
    engine_overhead = tensors * a.engine_us_per_tensor * 1e-6

    def collectives(nbytes: float) -> float:
        return max(1.0, nbytes / (a.bucket_mib * 2**20)) * a.latency_us * 1e-6

    # gather: full tensors on every rank (TP gather of the dense part, EP gather of the experts).
    g_dense, g_exp = dense * (tp - 1) / tp, experts * (ep - 1) / ep if ep > 1 else 0.0
    gather_s = (
        g_dense / nvlink
        + collectives(g_dense)
        + g_exp / ep_bw
        + collectives(g_exp)
        + (dense + experts) / hbm
        + engine_overhead
    )
    # aligned: each engine rank receives only its slice: dense slices local when rtp is a multiple of tp;
    # the replica's experts (1/rtp of them per engine rank) gathered within the replica (one node).
    exp_need = experts / rtp if m.num_experts else 0.0
    exp_local = experts / ep if m.num_experts else 0.0
    a_recv = max(0.0, exp_need - exp_local) + (0.0 if rtp % tp == 0 else dense / rtp)
    aligned_s = a_recv / nvlink + collectives(a_recv) + (dense / rtp + exp_need) / hbm + engine_overhead
    return dict(
        config=config,
        layout=lay,
        weights_gb=(dense + experts) / GB,
        hf_tensors=tensors,
        gather_bytes_received_gb=(g_dense + g_exp) / GB,
        gather_s=gather_s,
        aligned_bytes_received_gb=a_recv / GB,
        aligned_s=aligned_s,
    )


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "weight_sync.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        help="model override for the measured run (repeatable), e.g. model.hidden_size=512",
    )
    ap.add_argument("--nvlink-gbps", type=float, default=360.0)
    ap.add_argument("--ib-gbps", type=float, default=45.0)
    ap.add_argument("--hbm-gbps", type=float, default=1500.0)
    ap.add_argument("--bucket-mib", type=float, default=512.0)
    ap.add_argument("--latency-us", type=float, default=30.0)
    ap.add_argument("--engine-us-per-tensor", type=float, default=50.0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    model = a.model or [
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.ffn_hidden_size=768",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "model.head_dim=32",
        "model.vocab_size=4096",
    ]
    if a.worker:
        _worker(a.worker, a.reps, model)
        return {}
    measured = [row for tp in (1, 2) for row in _measure(tp, a.reps, model)]
    print_table(
        measured,
        [
            ("tp", "TP", "d"),
            ("rank", "rank", "d"),
            ("params", "params", ",d"),
            ("export_s", "export s", ".4f"),
            ("load_s", "engine load s", ".4f"),
            ("bytes_received", "received B", ",d"),
            ("bytes_to_engine", "to engine B", ",d"),
        ],
        title="measured on this machine (CPU, gloo, a torch engine on every rank):",
    )
    projected = [project(name, a) for name in ("qwen3_14b_multihop.yaml", "qwen3_30b_a3b_bfcl.yaml")]
    print()
    print_table(
        projected,
        [
            ("config", "config", "<"),
            ("weights_gb", "weights GB", ".1f"),
            ("hf_tensors", "tensors", ",d"),
            ("gather_bytes_received_gb", "gather: recv GB", ".1f"),
            ("gather_s", "gather s", ".3f"),
            ("aligned_bytes_received_gb", "aligned: recv GB", ".1f"),
            ("aligned_s", "aligned s", ".3f"),
        ],
        title=f"projected per rank on H100 (NVLink {a.nvlink_gbps:g} GB/s, IB {a.ib_gbps:g} GB/s, HBM "
        f"{a.hbm_gbps:g} GB/s, buckets {a.bucket_mib:g} MiB, {a.latency_us:g} us per collective, "
        f"{a.engine_us_per_tensor:g} us per tensor in the engine); anchor: NeMo-RL 0.74-1.0 s for "
        f"Qwen3-30B-A3B",
    )
    result = {
        "command": command_line(__file__, argv),
        "measured": measured,
        "projected": projected,
        "assumptions": {
            k: getattr(a, k)
            for k in ("nvlink_gbps", "ib_gbps", "hbm_gbps", "bucket_mib", "latency_us", "engine_us_per_tensor")
        },
    }
    write_json(result, a.json)
    return result


if __name__ == "__main__":
    main()
