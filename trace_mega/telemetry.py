"""Metrics sink (JSONL + TensorBoard), the per-step log line, GPU telemetry, plots.

GPU utilisation, memory and power come from nvidia-ml-py when a GPU and its
driver are present; without them `GpuProbe` reports nothing (NVML raises
`pynvml.NVMLError`, which is caught once at start).
"""
from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

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


class MetricsSink:
    """Writes one JSON object per step to `metrics.jsonl` (and TensorBoard scalars)."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any], *, tag: str = "") -> str:
        """Record `metrics` of `step`; returns the human log line (also sent to the logger)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not k.startswith("_")}
        line = " | ".join(fmt.format(scalars[k]) for k, fmt in LOG_LINE_KEYS if k in scalars and math.isfinite(scalars[k]))
        line = f"{tag}step {step:>4} | {line}"
        if self.enabled:
            self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self._jsonl.flush()
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.add_scalar(k, v, step)
        log.info(line)
        return line

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl (the last record wins for a repeated step, e.g. after a resume)."""
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def plot_curves(runs: dict[str, list[dict[str, float]]], keys: list[str], path: str | Path,
                title: Optional[str] = None) -> Path:
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
