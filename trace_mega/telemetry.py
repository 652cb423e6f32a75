"""Metrics sink (JSONL + TensorBoard + Weights & Biases), the per-step log line, GPU telemetry, tree metrics, plots.

GPU utilisation, memory and power come from nvidia-ml-py when a GPU and its
driver are present; without them `GpuProbe` reports nothing (NVML raises
`pynvml.NVMLError`, which is caught once at start).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

if TYPE_CHECKING:
    from trace_mega.config import ModelConfig, TelemetryConfig
    from trace_mega.rollout.tree import PackedTrees

log = logging.getLogger("trace_mega")


class GpuProbe:
    """Per-device utilisation / memory / power through NVML; empty without a GPU."""

    def __init__(self) -> None:
        self._nvml = None
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # pynvml.NVMLError without a driver; ImportError without the package
            self._handles = []

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        nv = self._nvml
        for i, h in enumerate(self._handles):
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out[f"gpu{i}/util_pct"] = float(util.gpu)
            out[f"gpu{i}/mem_used_gib"] = mem.used / 2**30
            out[f"gpu{i}/power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        return out


class PhaseTimer:
    """Seconds per named phase of a step (`with timer("rollout"): ...`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time/{name}_s"] = self.seconds.get(f"time/{name}_s", 0.0) + time.perf_counter() - t0


def tree_metrics(packed: "PackedTrees", groups: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Effective ratio and contrast counts of a step's trees (binary rewards: success = reward > 0.5).
    With `groups` (one eval group per tree, `evaluation.group_of`), also per group g the prompts the step
    holds and how many are contrasted, `alloc/group/<g>/prompts` and `.../contrasted_prompts`: which
    prompts an allocator spends on and which it starves."""
    leaf_success = (packed.leaf_reward > 0.5).float()
    tree_of_leaf = packed.node_tree[packed.leaf_nodes]
    n_trees = packed.num_trees
    succ = torch.zeros(n_trees).index_add(0, tree_of_leaf, leaf_success)
    count = torch.zeros(n_trees).index_add(0, tree_of_leaf, torch.ones_like(leaf_success))
    active = count > 0
    contrasted = active & (succ > 0) & (succ < count)
    # Branch points: nodes with >= 2 children; contrasted when their leaves disagree.
    children = torch.bincount(packed.node_parent[packed.node_parent >= 0], minlength=packed.num_nodes)
    branch = children >= 2
    mean = packed.node_reward_sum / packed.node_leaf_count.clamp(min=1)
    mixed = branch & (mean > 0) & (mean < 1)
    by_group: dict[str, float] = {}
    for g, *counts in zip(groups or (), active.tolist(), contrasted.tolist()):
        for what, n in zip(("prompts", "contrasted_prompts"), counts):
            key = f"alloc/group/{g}/{what}"
            by_group[key] = by_group.get(key, 0.0) + n
    return by_group | {
        "alloc/effective_ratio": float(contrasted.sum() / active.sum().clamp(min=1)),
        "alloc/active_prompts": float(active.sum()),
        "alloc/contrasted_prompts": float(contrasted.sum()),
        "alloc/branch_points": float(branch.sum()),
        "alloc/contrasted_groups": float(mixed.sum()),
        "alloc/trajectories": float(packed.leaf_nodes.numel()),
        "reward/mean": float(packed.leaf_reward.mean()) if packed.leaf_nodes.numel() else 0.0,
        # Turns of each root-to-leaf trajectory (a continuation counts its shared prefix's turns too).
        "rollout/turns_per_episode": float(packed.node_depth[packed.leaf_nodes].float().mean())
        if packed.leaf_nodes.numel()
        else 0.0,
    }


# Dense bf16 tensor-core peak per GPU (vendor datasheets, no sparsity), by device-name substring.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device: torch.device) -> Optional[float]:
    """The device's dense bf16 peak FLOP/s, or None (CPU, or a GPU not in `PEAK_BF16_FLOPS`)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def forward_flops(m: "ModelConfig", tokens: float, attended_keys: float) -> float:
    """Model FLOPs of a forward pass over `tokens` tokens that attend to `attended_keys` keys in all
    (2 FLOPs per multiply-add; docs/learner.md "Throughput and MFU"): per token and layer the Q, K,
    V and output projections, the MLP (gate, up, down; for MoE the top-k experts and the router),
    then the LM head; per attended key and layer QK^T and AV (2 x heads x head_dim multiply-adds).
    Norms, rotary and softmax are left out, as in Megatron-LM's and PaLM's MFU."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    proj = h * (q + 2 * kv) + q * h
    if m.num_experts:
        mlp = m.moe_router_topk * 3 * h * (m.moe_ffn_hidden_size or m.ffn_hidden_size) + h * m.num_experts
    else:
        mlp = 3 * h * m.ffn_hidden_size
    per_token = m.num_layers * (proj + mlp) + h * m.vocab_size
    return 2.0 * per_token * tokens + 2.0 * m.num_layers * 2 * q * attended_keys


def response_lengths(packed: "PackedTrees") -> torch.Tensor:
    """Generated tokens on each root-to-leaf trajectory ([L], leaves in pre-order; a continuation
    counts its shared prefix's generated tokens too)."""
    gen = torch.bincount(packed.token_node[packed.loss_mask], minlength=packed.num_nodes).double()
    total = gen.clone()
    for d in range(1, int(packed.node_depth.max()) + 1 if packed.num_nodes else 0):
        at = (packed.node_depth == d).nonzero().flatten()
        total[at] += total[packed.node_parent[at]]  # parents (depth d-1) are final already
    return total[packed.leaf_nodes]


def throughput_metrics(
    packed: "PackedTrees",
    step_s: float,
    model: "ModelConfig",
    *,
    world_size: int,
    replicas: int,
    epochs: int,
    device: torch.device,
) -> dict[str, float]:
    """Per-step throughput as verl / NeMo-RL report it: generated and trained tokens per second (per
    replica and per GPU), response lengths, and on a GPU with a known peak the model FLOPs
    utilisation: `epochs` x 3 forward passes (forward + backward) over the trained tokens plus one
    over the generated tokens (their prefill reuses cached KV), over step_s x GPUs x peak."""
    step_s = max(step_s, 1e-9)
    generated = packed.loss_mask
    trained = float(packed.tokens.numel())
    lengths = response_lengths(packed)
    out = {
        "perf/step_s": step_s,
        "perf/generated_tokens_per_s": float(generated.sum()) / step_s,
        "perf/generated_tokens_per_s_per_replica": float(generated.sum()) / step_s / replicas,
        "perf/generated_tokens_per_s_per_gpu": float(generated.sum()) / step_s / world_size,
        "perf/trained_tokens_per_s": trained / step_s,
        "perf/trained_tokens_per_s_per_gpu": trained / step_s / world_size,
        "rollout/response_length_mean": float(lengths.mean()) if lengths.numel() else 0.0,
        "rollout/response_length_max": float(lengths.max()) if lengths.numel() else 0.0,
        "perf/peak_memory_gib": peak_memory_gib(device),
    }
    peak = peak_flops(device)
    if peak is not None:
        keys = (packed.position_ids + 1).double()  # a token attends to its ancestors and itself
        flops = 3 * epochs * forward_flops(model, trained, float(keys.sum()))
        flops += forward_flops(model, float(generated.sum()), float(keys[generated].sum()))
        out["perf/mfu"] = flops / (step_s * world_size * peak)
    return out


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far, GiB: on a GPU the caching allocator's peak of allocated
    tensors (what a config's plan must fit), on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


# The keys shown on the one-line-per-step log, in order, with their format.
LOG_LINE_KEYS = [
    ("reward/mean", "reward {:.3f}"),
    ("alloc/effective_ratio", "eff {:.2f}"),
    ("alloc/contrasted_groups", "groups {:.0f}"),
    ("predictor/brier", "brier {:.3f}"),
    ("loss/kl_ref", "kl {:.4f}"),
    ("loss/token_entropy", "ent {:.3f}"),
    ("mismatch/k3", "mismatch {:.1e}"),  # k3 KL(engine || learner): docs/learner.md "Training–inference mismatch"
    ("moe/own_routing_k3", "unreplayed {:.1e}"),  # the same without replay (model.moe_replay_probe)
    ("rollout/generated_tokens", "gen {:.0f}tok"),
    ("rollout/prefill_tokens_saved", "saved {:.0f}tok"),
    ("time/step_s", "{:.1f}s"),
]

_EVAL_PASS1 = re.compile(r"^eval/[^/]+/pass@1$")


class MetricsSink:
    """Writes one JSON object per step to `metrics.jsonl`, and the same scalars under the same
    names to TensorBoard and (when `wandb_init` is given) a Weights & Biases run."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        tensorboard: bool = True,
        enabled: bool = True,
        wandb_init: Optional[dict[str, Any]] = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))
        if wandb_init is not None:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("telemetry.wandb_project needs wandb: pip install 'trace-mega[wandb]'") from err
            # A run per launch (a resumed run starts a new W&B run: its steps restart below the last one).
            self._wandb = wandb.init(dir=str(self.out_dir), **wandb_init)

    @classmethod
    def from_config(cls, cfg: "TelemetryConfig", run_config: dict[str, Any], *, enabled: bool = True) -> "MetricsSink":
        """The sink `cfg` describes; `run_config` (the whole TrainConfig as a dict) is W&B's run config."""
        wandb_init = None
        if cfg.wandb_project:
            wandb_init = {
                "project": cfg.wandb_project,
                "entity": cfg.wandb_entity,
                "name": cfg.wandb_run_name,
                "mode": cfg.wandb_mode,
                "config": run_config,
            }
        return cls(cfg.out_dir, tensorboard=cfg.tensorboard, enabled=enabled, wandb_init=wandb_init)

    def log(self, step: int, metrics: dict[str, Any], *, tag: str = "") -> str:
        """Record `metrics` of `step`; returns the human log line (also sent to the logger)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not k.startswith("_")}
        parts = [fmt.format(scalars[k]) for k, fmt in LOG_LINE_KEYS if k in scalars and math.isfinite(scalars[k])]
        # Validation steps (eval.every_steps): pass@1 over all tasks of the split.
        parts += [f"{k.split('/')[1]} pass@1 {v:.3f}" for k, v in scalars.items() if _EVAL_PASS1.match(k)]
        line = " | ".join(parts)
        line = f"{tag}step {step:>4} | {line}"
        if self.enabled:
            self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self._jsonl.flush()
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.add_scalar(k, v, step)
            if self._wandb is not None:
                self._wandb.log(scalars, step=step)
        log.info(line)
        return line

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl (the last record wins for a repeated step, e.g. after a resume)."""
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def plot_curves(
    runs: dict[str, list[dict[str, float]]], keys: list[str], path: str | Path, title: Optional[str] = None
) -> Path:
    """One panel per metric key, one line per run (e.g. uniform vs trace); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for i, (name, rows) in enumerate(runs.items()):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:  # a fixed colour per run, so a run missing from one panel keeps its colour in the others
                ax.plot(*zip(*pts), marker="o", ms=3, label=name, color=f"C{i % 10}")
        ax.set(xlabel="step", title=key)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
