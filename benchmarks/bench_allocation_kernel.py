"""Benchmark: the device-side allocation hot paths, the tensor program against the Triton kernel.

On CUDA it times, at the issue's sizes (roots B = 4,096, max_rollouts = 16,
budget = 32,768; prefixes P = 100,000 in 4,096 groups):
* `allocate_roots` on the GPU (tensor program; no host sync with check=False);
* `segmented_threshold` with backend "torch" (64 bisection steps on the full
  table, no sync) and backend "triton" (one launch), checking both give the same K;
* the same calls on the CPU, for reference.
Without CUDA it times the CPU tensor program only and says so. The Triton
path can only run there through the interpreter, which is not a timing.

    python benchmarks/bench_allocation_kernel.py [--json PATH]
    trace-mega bench allocation_kernel [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from trace_mega.allocation import allocate_roots
from trace_mega.kernels.allocation import segmented_threshold


def _time(fn, repeats: int = 10, cuda: bool = False) -> float:
    """Median seconds per call after two warm-ups (CUDA-synchronised around each call when on GPU)."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench_results/allocation_kernel.json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    v = torch.tensor(rng.beta(0.3, 0.3, 4096))
    P, G = 100_000, 4096
    group = torch.tensor(np.sort(rng.integers(0, G, P)))
    flip = torch.tensor(rng.random(P))
    budget = torch.tensor(rng.integers(0, 17, G))
    cap = budget[group]
    width = int(torch.bincount(group).max())
    rows = {"cpu_roots_s": _time(lambda: allocate_roots(v, 32768, 16, check=False)),
            "cpu_prefix_torch_s": _time(lambda: segmented_threshold(flip, group, budget, cap, max_group_size=width))}
    if torch.cuda.is_available():
        d = [t.cuda() for t in (v, flip, group, budget, cap)]
        rows["gpu_roots_s"] = _time(lambda: allocate_roots(d[0], torch.tensor(32768, device="cuda"), 16, check=False),
                                    cuda=True)
        k_t = segmented_threshold(*d[1:], backend="torch", max_group_size=width)
        k_k = segmented_threshold(*d[1:], backend="triton", max_group_size=width)
        rows["gpu_prefix_torch_s"] = _time(lambda: segmented_threshold(*d[1:], max_group_size=width), cuda=True)
        rows["gpu_prefix_triton_s"] = _time(
            lambda: segmented_threshold(*d[1:], backend="triton", max_group_size=width), cuda=True)
        rows["triton_equals_torch"] = bool(torch.equal(k_t, k_k))
        rows["triton_speedup_vs_torch"] = rows["gpu_prefix_torch_s"] / rows["gpu_prefix_triton_s"]
    else:
        rows["note"] = "no CUDA device: Triton runs only in the interpreter here, so only the CPU tensor program is timed"
    print(f"{'measurement':<28}{'value':>14}")
    for k, val in rows.items():
        print(f"{k:<28}{val:>14.5f}" if isinstance(val, float) else f"{k:<28}{str(val):>14}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
