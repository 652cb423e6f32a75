"""Benchmark: cost of the kernel jail (`isolation="bwrap"`) against the audit-hook-only mode (`"weak"`).

For each cell, both modes in the same run:

1. latency: `--calls` calls one at a time, the two modes interleaved call by call
   (so a change in machine load hits both alike); median and p90 of the wall
   time of `Sandbox.run`, and the median added by the jail;
2. concurrency: for each of `--concurrency` (default 4 and 64, the agent loop's
   default with 64 episodes in flight), `max(--calls, 2 * c)` calls through
   `run_many` on a sandbox with `max_workers = c`: calls/s, the median and p90
   wall time of one call while c run at once (on a machine with fewer cores
   than c, the calls share the cores: the median grows with c while calls/s
   shows what the jail costs once the cores are saturated).

Cells: `pass` (pure start-up cost), a small computation, and `import numpy`
(what a math cell typically does first).

    python benchmarks/bench_sandbox.py [--calls 40] [--concurrency 4,64] [--json PATH]
    trace-mega bench sandbox [same options]

The jail needs root and bubblewrap (see docs/envs.md); without it the script
says why and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
    parser.add_argument(
        "--concurrency", default="4,64", help="comma-separated numbers of calls at once for the throughput rows"
    )
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    limits = SandboxLimits(wall_s=120.0, cpu_s=60)  # generous: nothing here should hit a limit
    try:
        boxes = {m: Sandbox(limits=limits, max_workers=1, isolation=m) for m in MODES}
    except RuntimeError as err:
        print(f"bench_sandbox: {err}", file=sys.stderr)
        sys.exit(1)
    logging.getLogger("trace_mega.envs.sandbox").setLevel(logging.ERROR)  # warned once above; one per box
    rows, conc = [], []
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
        for mode in MODES:
            rows.append(
                {
                    "cell": cell,
                    "mode": mode,
                    "median_ms": 1e3 * statistics.median(lat[mode]),
                    "p90_ms": 1e3 * _quantile(lat[mode], 0.9),
                    "added_median_ms": 1e3 * (statistics.median(lat[mode]) - statistics.median(lat["weak"])),
                }
            )
        for c in levels:
            for mode in MODES:
                conc.append({"cell": cell, "mode": mode, "concurrency": c, **_at_once(code, mode, c, args, limits)})
    for box in boxes.values():
        box.close()
    load = os.getloadavg()
    print(
        f"sandbox per-call cost: {args.calls} calls per mode and cell; {os.cpu_count()} CPUs, load average {load[0]:.1f}"
    )
    print("| cell | mode | median ms | p90 ms | added by the jail (median) ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        added = f"{r['added_median_ms']:+.1f}" if r["mode"] == "bwrap" else "—"
        print(f"| {r['cell']} | {r['mode']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {added} |")
    print()
    print("| cell | mode | calls at once | calls/s | median call ms | p90 call ms |")
    print("|---|---|---|---|---|---|")
    for r in conc:
        print(
            f"| {r['cell']} | {r['mode']} | {r['concurrency']} | {r['calls_per_s']:.1f} | {r['median_ms']:.0f} | "
            f"{r['p90_ms']:.0f} |"
        )
    out = {"calls": args.calls, "cpus": os.cpu_count(), "loadavg": load, "rows": rows, "concurrency": conc}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


def _at_once(code: str, mode: str, c: int, args, limits: SandboxLimits) -> dict:
    """`max(calls, 2c)` calls, `c` at once, on a fresh sandbox of `c` workers (what `run_many` does,
    with each call's wall time taken inside its worker thread)."""
    n = max(args.calls, 2 * c)
    box = Sandbox(limits=limits, max_workers=c, isolation=mode)

    def timed(cell: str) -> tuple[float, object]:
        t0 = time.perf_counter()
        res = box.run(cell)
        return time.perf_counter() - t0, res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        out = list(pool.map(timed, [code] * n))
    wall = time.perf_counter() - t0
    box.close()
    durations = [d for d, _ in out]
    bad = [r for _, r in out if r.status != "ok"]
    assert not bad, (mode, c, bad[0].status, bad[0].output)
    return {
        "calls": n,
        "calls_per_s": n / wall,
        "median_ms": 1e3 * statistics.median(durations),
        "p90_ms": 1e3 * _quantile(durations, 0.9),
    }


if __name__ == "__main__":
    main()
