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
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

if TYPE_CHECKING:
    from trace_mega.config import TelemetryConfig
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


def tree_metrics(packed: "PackedTrees") -> dict[str, float]:
    """Effective ratio and contrast counts of a step's trees (binary rewards: success = reward > 0.5)."""
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
    return {
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


# The keys shown on the one-line-per-step log, in order, with their format.
LOG_LINE_KEYS = [
    ("reward/mean", "reward {:.3f}"),
    ("alloc/effective_ratio", "eff {:.2f}"),
    ("alloc/contrasted_groups", "groups {:.0f}"),
    ("predictor/brier", "brier {:.3f}"),
    ("loss/kl_ref", "kl {:.4f}"),
    ("loss/token_entropy", "ent {:.3f}"),
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
