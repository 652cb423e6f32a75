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

import numpy as np
import torch
from harness import RESULTS, parser, print_table, timeit, write_json

from trace_mega.allocation import allocate_roots
from trace_mega.kernels.allocation import segmented_threshold


def _time(fn, device: str = "cpu") -> float:
    """Median seconds per call of 10 after two warm-ups."""
    return timeit(fn, reps=10, warmup=2, device=device)


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, RESULTS / "allocation_kernel.json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    v = torch.tensor(rng.beta(0.3, 0.3, 4096))
    P, G = 100_000, 4096
    group = torch.tensor(np.sort(rng.integers(0, G, P)))
    flip = torch.tensor(rng.random(P))
    budget = torch.tensor(rng.integers(0, 17, G))
    cap = budget[group]
    width = int(torch.bincount(group).max())
    rows = {
        "cpu_roots_s": _time(lambda: allocate_roots(v, 32768, 16, check=False)),
        "cpu_prefix_torch_s": _time(lambda: segmented_threshold(flip, group, budget, cap, max_group_size=width)),
    }
    if torch.cuda.is_available():
        d = [t.cuda() for t in (v, flip, group, budget, cap)]
        rows["gpu_roots_s"] = _time(
            lambda: allocate_roots(d[0], torch.tensor(32768, device="cuda"), 16, check=False), "cuda"
        )
        k_t = segmented_threshold(*d[1:], backend="torch", max_group_size=width)
        k_k = segmented_threshold(*d[1:], backend="triton", max_group_size=width)
        rows["gpu_prefix_torch_s"] = _time(lambda: segmented_threshold(*d[1:], max_group_size=width), "cuda")
        rows["gpu_prefix_triton_s"] = _time(
            lambda: segmented_threshold(*d[1:], backend="triton", max_group_size=width), "cuda"
        )
        rows["triton_equals_torch"] = bool(torch.equal(k_t, k_k))
        rows["triton_speedup_vs_torch"] = rows["gpu_prefix_torch_s"] / rows["gpu_prefix_triton_s"]
    else:
        rows["note"] = (
            "no CUDA device: Triton runs only in the interpreter here, so only the CPU tensor program is timed"
        )
    print_table(
        [{"measurement": k, "value": f"{val:.5f}" if isinstance(val, float) else str(val)} for k, val in rows.items()],
        [("measurement", "measurement", "<"), ("value", "value", "<")],
    )
    write_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
