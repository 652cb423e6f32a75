"""Calibration of the success predictor: Brier score, ECE, reliability curve.

Targets may be soft (an internal node's target is the mean reward of its
terminal descendants), so every metric is defined for targets in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Calibration:
    brier: float
    """Mean squared error of the predictions against the (soft) targets."""
    brier_constant: float
    """Brier score of the constant predictor (`constant`, default the targets' own mean): the bar to beat."""
    ece: float
    """Expected calibration error: bin-mass-weighted |mean prediction - mean target|."""
    bin_confidence: list[float]
    """Mean prediction per non-empty bin (reliability curve x)."""
    bin_accuracy: list[float]
    """Mean target per non-empty bin (reliability curve y)."""
    bin_count: list[int]
    """Samples per non-empty bin."""
    num_samples: int

    @property
    def skill(self) -> float:
        """Brier skill score 1 - brier / brier_constant (> 0: better than a constant)."""
        if self.brier_constant <= 0:
            return 0.0 if self.brier <= 0 else float("-inf")
        return 1.0 - self.brier / self.brier_constant


def calibration(
    pred: torch.Tensor, target: torch.Tensor, num_bins: int = 10, constant: float | None = None
) -> Calibration:
    """Calibration of predictions `pred` (N,) in [0, 1] against targets (N,) in [0, 1].

    `constant` is the constant predictor to compare with; the default, the
    targets' own mean, is the best constant in hindsight (an oracle bar).
    """
    pred = pred.detach().double().flatten()
    target = target.detach().double().flatten()
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    n = pred.numel()
    if n == 0:
        return Calibration(0.0, 0.0, 0.0, [], [], [], 0)
    brier = torch.mean((pred - target) ** 2).item()
    const = target.mean() if constant is None else torch.tensor(float(constant), dtype=torch.float64)
    brier_const = torch.mean((target - const) ** 2).item()
    if not bool(torch.isfinite(pred).all()):  # a broken forward: no score, no bins (and no crash binning NaN)
        nan = float("nan")
        return Calibration(nan, brier_const, nan, [], [], [], n)
    # Bin b holds predictions in [b/num_bins, (b+1)/num_bins); 1.0 goes to the last bin.
    bins = torch.clamp((pred * num_bins).long(), max=num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins).double()
    conf = torch.bincount(bins, weights=pred, minlength=num_bins)
    acc = torch.bincount(bins, weights=target, minlength=num_bins)
    nz = count > 0
    ece = (torch.abs(conf[nz] - acc[nz]).sum() / n).item()
    return Calibration(
        brier=brier,
        brier_constant=brier_const,
        ece=ece,
        bin_confidence=(conf[nz] / count[nz]).tolist(),
        bin_accuracy=(acc[nz] / count[nz]).tolist(),
        bin_count=count[nz].long().tolist(),
        num_samples=n,
    )


def plot_reliability(cal: Calibration, path: str | Path, title: str = "Predictor reliability") -> Path:
    """Save the reliability curve (mean target vs mean prediction per bin) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect")
    sizes = [20 + 200 * c / max(1, max(cal.bin_count, default=1)) for c in cal.bin_count]
    ax.scatter(cal.bin_confidence, cal.bin_accuracy, s=sizes, zorder=3)
    ax.plot(cal.bin_confidence, cal.bin_accuracy, "-o", ms=0)
    ax.set(
        xlim=(0, 1),
        ylim=(0, 1),
        xlabel="predicted success",
        ylabel="observed success",
        title=f"{title}\nBrier {cal.brier:.3f} (const {cal.brier_constant:.3f}), ECE {cal.ece:.3f}",
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
