"""Benchmark: cost of the kernel jail (`isolation="bwrap"`) against the audit-hook-only mode (`"weak"`).

For each cell, both modes in the same run:

1. latency: `--calls` calls one at a time, the two modes interleaved call by call
   (so a change in machine load hits both alike); median and p90 of the wall
   time of `Sandbox.run`, and the median added by the jail;
2. throughput: `--calls` calls through `run_many` with `--workers` at once, in calls/s.

Cells: `pass` (pure start-up cost), a small computation, and `import numpy`
(what a math cell typically does first).

    python benchmarks/bench_sandbox.py [--calls 40] [--workers 4] [--json PATH]
    trace-mega bench sandbox [same options]

The jail needs root and bubblewrap (see docs/envs.md); without it the script
says why and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from trace_mega.envs.sandbox import Sandbox, SandboxLimits

CELLS = {
    "pass": "pass",
    "sum(range(10**6))": "print(sum(range(10 ** 6)))",
    "import numpy": "import numpy\nprint(numpy.arange(10).sum())",
}
MODES = ("weak", "bwrap")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="calls per mode and cell, for each measurement")
    parser.add_argument("--workers", type=int, default=4, help="concurrent calls in the throughput measurement")
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    args = parser.parse_args(argv)
    limits = SandboxLimits(wall_s=60.0, cpu_s=30)  # generous: nothing here should hit a limit
    try:
        boxes = {m: Sandbox(limits=limits, max_workers=args.workers, isolation=m) for m in MODES}
    except RuntimeError as err:
        print(f"bench_sandbox: {err}", file=sys.stderr)
        sys.exit(1)
    rows = []
    for cell, code in CELLS.items():
        for box in boxes.values():  # warm-up: page cache, the jail's interpreter-path probe
            assert box.run(code).status == "ok"
        lat = {m: [] for m in MODES}
        for _ in range(args.calls):
            for mode, box in boxes.items():
                t0 = time.perf_counter()
                res = box.run(code)
                lat[mode].append(time.perf_counter() - t0)
                assert res.status == "ok", (mode, cell, res.status, res.output)
        tput = {}
        for mode, box in boxes.items():
            t0 = time.perf_counter()
            results = box.run_many([code] * args.calls)
            tput[mode] = args.calls / (time.perf_counter() - t0)
            assert all(r.status == "ok" for r in results)
        for mode in MODES:
            rows.append(
                {
                    "cell": cell,
                    "mode": mode,
                    "median_ms": 1e3 * statistics.median(lat[mode]),
                    "p90_ms": 1e3 * _quantile(lat[mode], 0.9),
                    "calls_per_s": tput[mode],
                    "added_median_ms": 1e3 * (statistics.median(lat[mode]) - statistics.median(lat["weak"])),
                }
            )
    for box in boxes.values():
        box.close()
    load = os.getloadavg()
    print(
        f"sandbox per-call cost: {args.calls} calls per mode and cell; throughput with {args.workers} at once; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f}"
    )
    print("| cell | mode | median ms | p90 ms | added by the jail (median) ms | calls/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        added = f"{r['added_median_ms']:+.1f}" if r["mode"] == "bwrap" else "—"
        print(
            f"| {r['cell']} | {r['mode']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {added} | {r['calls_per_s']:.1f} |"
        )
    out = {"calls": args.calls, "workers": args.workers, "cpus": os.cpu_count(), "loadavg": load, "rows": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
