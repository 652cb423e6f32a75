"""The small harness every `benchmarks/bench_*.py` shares: arguments, timing, table, JSON.

A benchmark is a module with ``main(argv=None) -> dict``. It builds its argument
parser with :func:`parser` (its docstring as the help, and the ``--json PATH``
option every benchmark has; ``--json ''`` writes nothing), times with
:func:`timeit` (warm-up, repetitions, one statistic; CUDA events on a GPU) or
:func:`timed` (one call), prints with :func:`print_table` and ends with
:func:`write_json`. Run one as ``python benchmarks/bench_NAME.py`` (this directory
is then on ``sys.path``) or as ``trace-mega bench NAME`` (`trace_mega.commands.cli.load_benchmark`
puts it there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = (ROOT if (ROOT / "pyproject.toml").is_file() else Path.cwd()) / "bench_results"
"""Where results go by default: bench_results/ of the checkout, or of the working directory
when the benchmarks run from an installed wheel (ROOT is then the package directory)."""

__all__ = ["ROOT", "RESULTS", "parser", "timeit", "timed", "print_table", "write_json", "command_line"]

_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_REDUCE = {"median": statistics.median, "min": min, "mean": statistics.fmean}


def parser(doc: str, json_default: str | Path | None) -> argparse.ArgumentParser:
    """An ArgumentParser showing `doc` (the benchmark's docstring) as its help, with ``--json``.

    ``json_default`` None: the benchmark picks the path after parsing (e.g. per device).
    """
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = str(json_default) if json_default is not None else "a per-device file under bench_results/"
    ap.add_argument(
        "--json",
        default=None if json_default is None else str(json_default),
        help=f"write the results here ('' = do not write; default: {where})",
    )
    return ap


def _is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def timeit(
    fn: Callable[[], Any],
    *,
    reps: int = 5,
    warmup: int = 1,
    device: Any = "cpu",
    reduce: str = "median",
    clock: str = "wall",
) -> float:
    """Seconds per call of ``fn()``: `warmup` untimed calls, then `reps` timed ones reduced by `reduce`.

    On CUDA each call is timed with CUDA events (so queued work is counted and the host
    overhead of launching is included). Elsewhere `clock` is "wall" (perf_counter) or
    "process" (CPU time of this process: on a shared machine it leaves out the time spent
    waiting for other jobs; only meaningful single-threaded). `reduce`: median | min | mean.
    The results of ``fn`` are dropped right away (memory peaks measured around it stay fair).
    """
    if reduce not in _REDUCE or clock not in _CLOCKS:
        raise ValueError(f"reduce must be one of {sorted(_REDUCE)}, clock one of {sorted(_CLOCKS)}")
    for _ in range(warmup):
        fn()
    times = []
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        now = _CLOCKS[clock]
        for _ in range(reps):
            t0 = now()
            fn()
            times.append(now() - t0)
    return float(_REDUCE[reduce](times))


def timed(fn: Callable[[], Any], *, clock: str = "wall") -> tuple[Any, float]:
    """``(fn(), seconds)`` of ONE call: for work too slow to repeat, or whose result is needed."""
    now = _CLOCKS[clock]
    t0 = now()
    out = fn()
    return out, now() - t0


def print_table(rows: Sequence[dict], cols: Sequence[tuple[str, str, str]], *, title: str | None = None) -> None:
    """Print `rows` as an aligned table. cols: (key, header, format spec); a spec starting with '<'
    aligns left (the rest is the spec proper, '' = str); a row without the key, or with None there (a
    threshold never reached), shows '-'."""
    if title:
        print(title)
    cells = [[format(r[key], fmt.lstrip("<")) if r.get(key) is not None else "-" for key, _, fmt in cols] for r in rows]
    widths = [max([len(h)] + [len(c[n]) for c in cells]) for n, (_, h, _) in enumerate(cols)]
    just = [(str.ljust if fmt.startswith("<") else str.rjust) for _, _, fmt in cols]
    print("  ".join(j(h, w) for (_, h, _), w, j in zip(cols, widths, just)).rstrip())
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(j(x, w) for x, w, j in zip(c, widths, just)).rstrip())


def write_json(result: dict, path: str | Path | None) -> Path | None:
    """Write `result` as JSON to `path` (parents created) and say so; nothing when `path` is '' or None."""
    if not path:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, for the JSON (`script` is the benchmark's __file__)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", f"benchmarks/{Path(script).name}", *args])
