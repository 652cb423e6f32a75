"""`trace-mega sweep`: one short training run per point of a grid of config values, one table and plot.

    trace-mega sweep --config X [--steps 5] [--warmup-steps 1] [--out runs/sweep] KEY=V1,V2 ... [KEY=V ...]

Each `KEY=V1,V2,...` is an axis (values split at the commas outside brackets and
quotes, so `KEY=[1,2]` is one value); a `KEY=V` with one value applies to every
point. `nproc` is the processes per point: more than one runs the point under
`torchrun --nproc-per-node nproc` (the data-parallel size is what TP x PP leave
of it). Every point's config is loaded before the first runs, so a bad key or
value fails at once, naming the point and the field.

Each point trains `--steps` steps into `<out>/<NN>_<values>/` (its own
metrics.jsonl, the console output in `sweep_point.log`) and reports the mean over
the steps after the first `--warmup-steps` of: step time and its phases,
generated and trained tokens per second per GPU, MFU (on a GPU with a known
peak), peak memory (the largest step's), training-inference mismatch,
effective ratio, reward, MoE replay agreement when the policy replays
routing, and the last held-out eval reward when the config evaluates. A point that fails is a row with its exit code and last error line;
the others still run. Writes `sweep.md`, `sweep.json` and `sweep.png` in `<out>`;
exits 1 if any point failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# (metric key, column header, format, how steps combine): the table's metric columns, in order.
COLUMNS = [
    ("time/step_s", "step s", ".2f", "mean"),
    ("time/rollout_s", "rollout s", ".2f", "mean"),
    ("time/expand_s", "expand s", ".2f", "mean"),
    ("time/train_s", "train s", ".2f", "mean"),
    ("time/weight_sync_s", "sync s", ".3f", "mean"),
    ("perf/generated_tokens_per_s_per_gpu", "gen tok/s/GPU", ".1f", "mean"),
    ("perf/trained_tokens_per_s_per_gpu", "trained tok/s/GPU", ".1f", "mean"),
    ("perf/mfu", "MFU", ".3f", "mean"),
    ("perf/peak_memory_gib", "peak mem GiB", ".2f", "max"),
    ("mismatch/k3", "mismatch k3", ".1e", "mean"),
    ("loss/logprob_mismatch", "logprob mismatch", ".1e", "mean"),
    ("loss/clip_fraction", "clip frac", ".4f", "mean"),
    ("moe/own_routing_k3", "k3 own routing", ".1e", "mean"),  # the replay probe (model.moe_replay_probe)
    ("moe/replay_agreement", "replay agree", ".3f", "mean"),
    ("alloc/effective_ratio", "eff ratio", ".2f", "mean"),
    ("reward/mean", "reward", ".3f", "mean"),
]
# Step-time phases stacked in the plot (the rest of time/step_s is "other").
PHASES = ["rollout", "expand", "credit", "train", "predictor", "weight_sync"]
NPROC = "nproc"


def split_values(text: str) -> list[str]:
    """Split at the commas outside brackets, braces and quotes: `1,[2,3],'a,b'` -> 3 values."""
    out, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    if depth or quote or any(not v.strip() for v in out):
        raise ValueError(f"cannot split {text!r} into values (unbalanced brackets or quotes, or an empty value)")
    return [v.strip() for v in out]


@dataclass
class Grid:
    axes: list[tuple[str, list[str]]]
    """(key, values) of every axis with more than one value, in the order given."""
    fixed: list[str] = field(default_factory=list)
    """`key=value` overrides every point gets."""

    @classmethod
    def parse(cls, specs: list[str]) -> "Grid":
        axes, fixed, seen = [], [], set()
        for spec in specs:
            key, eq, text = spec.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"expected KEY=V1,V2,... or KEY=V, got {spec!r}")
            if key in seen:
                raise ValueError(f"{key} is given twice")
            seen.add(key)
            values = split_values(text)
            if key == NPROC and not all(v.isdigit() and int(v) >= 1 for v in values):
                raise ValueError(f"nproc takes positive integers, got {text!r}")
            if len(values) > 1 or key == NPROC:
                axes.append((key, values))
            else:
                fixed.append(f"{key}={values[0]}")
        return cls(axes, fixed)

    def points(self) -> list[dict[str, str]]:
        keys = [k for k, _ in self.axes]
        return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in self.axes))]


def point_name(index: int, values: dict[str, str]) -> str:
    """`03_nproc=2_expert_model_parallel_size=2`: the last part of each key, file-name safe."""
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in values.items()]
    return f"{index:02d}_" + re.sub(r"[^A-Za-z0-9_.=+-]+", "-", "_".join(parts))[:120]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def point_command(config: str, overrides: list[str], nproc: int) -> list[str]:
    """`python -m trace_mega train ...`, under torchrun when the point has several processes."""
    train = ["-m", "trace_mega", "train", "--config", config, *overrides]
    if nproc == 1:
        return [sys.executable, *train]
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port())]
    return [sys.executable, *launcher, *train]


def summarize(rows: list[dict], warmup_steps: int) -> dict[str, float]:
    """Per column, the steps after the warm-up combined (all steps when there are no others)."""
    kept = rows[warmup_steps:] or rows
    out = {}
    evals = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/reward")})
    for key in evals:  # held-out eval runs every eval.every_steps: the point's last one
        out[key] = [r[key] for r in rows if key in r][-1]
    for key, _, _, how in COLUMNS + [(f"time/{p}_s", "", "", "mean") for p in PHASES]:
        vals = [r[key] for r in kept if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if vals:
            out[key] = max(vals) if how == "max" else statistics.fmean(vals)
    return out


def _last_error(log_path: Path) -> str:
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|Exception|invalid config|error:)", ln)]
    return (errors or lines or ["(no output)"])[-1][-300:]


def run_point(cmd: list[str], out: Path, env: Optional[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "sweep_point.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    result = {"exit_code": code, "wall_s": time.perf_counter() - t0, "command": shlex.join(cmd)}
    if code != 0:
        result["error"] = _last_error(log_path)
    return result


def run_sweep(
    config: str,
    specs: list[str],
    *,
    steps: int,
    warmup_steps: int,
    out_dir: str,
    env: Optional[dict] = None,
) -> dict:
    """Validate every point's config, run the points one after the other, write the report."""
    from trace_mega.config import ConfigError, TrainConfig, load_yaml

    grid = Grid.parse(specs)
    root = Path(out_dir)
    points = []
    for i, values in enumerate(grid.points()):
        name = point_name(i, values)
        overrides = [f"{k}={v}" for k, v in values.items() if k != NPROC]
        overrides += grid.fixed + [f"steps={steps}", f"telemetry.out_dir={root / name}"]
        try:
            load_yaml(TrainConfig, config, overrides)
        except ConfigError as exc:
            raise ConfigError(f"sweep point {name}: {exc}") from None
        points.append({"name": name, "values": values, "overrides": overrides, "nproc": int(values.get(NPROC, 1))})
    for i, p in enumerate(points, 1):
        label = " ".join(f"{k}={v}" for k, v in p["values"].items()) or "(one point)"
        print(f"[{i}/{len(points)}] {label} ...", flush=True)
        p |= run_point(point_command(config, p["overrides"], p["nproc"]), root / p["name"], env)
        metrics_file = root / p["name"] / "metrics.jsonl"
        rows = [json.loads(ln) for ln in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
        p["steps_logged"] = len(rows)
        p["metrics"] = summarize(rows, warmup_steps)
        status = "ok" if p["exit_code"] == 0 else f"failed (exit {p['exit_code']}): {p['error']}"
        print(f"[{i}/{len(points)}] {label}: {status}, {p['wall_s']:.1f} s", flush=True)
    report = {
        "config": config,
        "steps": steps,
        "warmup_steps": warmup_steps,
        "axes": grid.axes,
        "fixed": grid.fixed,
        "command": "trace-mega sweep " + shlex.join(["--config", config, "--steps", str(steps), *specs]),
        "points": points,
    }
    write_report(report, root)
    return report


def markdown(report: dict) -> str:
    axes = [k for k, _ in report["axes"]]
    cols = [c for c in COLUMNS if any(c[0] in p["metrics"] for p in report["points"])]
    evals = sorted({k for p in report["points"] for k in p["metrics"] if k.startswith("eval/")})
    cols += [(k, f"eval {k.split('/')[1]} reward (last)", ".3f", "last") for k in evals]
    head = [*axes, "status", *(c[1] for c in cols)]
    lines = [
        f"Sweep of `{report['config']}`, {report['steps']} steps per point, means over the steps after the "
        f"first {report['warmup_steps']} (peak memory: the largest step's).",
        "",
        f"    {report['command']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for p in report["points"]:
        status = "ok" if p["exit_code"] == 0 else f"failed: {p['error']}".replace("|", "/")
        cells = [p["values"][k] for k in axes] + [status]
        cells += [format(p["metrics"][k], f) if k in p["metrics"] else "—" for k, _, f, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Four panels, one bar (group) per point: tokens per second per GPU, step time stacked by phase,
    peak memory, and training-inference mismatch (k3, log scale; with the replay probe, beside the
    k3 the learner's own routing would have had)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["points"]
    labels = ["\n".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in p["values"].items()) or "run" for p in pts]
    x = list(range(len(pts)))
    fig, axes = plt.subplots(2, 2, figsize=(max(8.0, 2.4 * len(pts)), 7.0))
    (tok, steps), (mem, mis) = axes

    def metric(key: str) -> list[float]:
        return [p["metrics"].get(key, 0.0) for p in pts]

    for off, key, name in [(-0.2, "generated", "generated"), (0.2, "trained", "trained")]:
        tok.bar([i + off for i in x], metric(f"perf/{key}_tokens_per_s_per_gpu"), width=0.4, label=name)
    tok.set_ylabel("tokens / s / GPU")
    tok.legend(fontsize=7)
    bottom = [0.0] * len(pts)
    for phase in PHASES:
        h = metric(f"time/{phase}_s")
        if any(h):
            steps.bar(x, h, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, h)]
    steps.bar(
        x,
        [max(t - b, 0.0) for t, b in zip(metric("time/step_s"), bottom)],
        bottom=bottom,
        label="other",
        color="lightgrey",
    )
    steps.set_ylabel("step time, s")
    steps.legend(fontsize=7)
    mem.bar(x, metric("perf/peak_memory_gib"), color="tab:purple")
    mem.set_ylabel("peak memory, GiB (rank 0)")
    k3 = [v if v > 0 else float("nan") for v in metric("mismatch/k3")]
    if any("moe/own_routing_k3" in p["metrics"] for p in pts):  # the replay probe: both, side by side
        own = [v if v > 0 else float("nan") for v in metric("moe/own_routing_k3")]
        mis.bar([i - 0.2 for i in x], k3, width=0.4, color="tab:red", label="replayed")
        mis.bar([i + 0.2 for i in x], own, width=0.4, color="tab:orange", label="own routing (probe)")
        mis.legend(fontsize=7)
    else:
        mis.bar(x, k3, color="tab:red")
    if any(v == v for v in k3):
        mis.set_yscale("log")
    mis.set_ylabel("mismatch k3 (engine || learner)")
    for ax in axes.flat:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
    fig.suptitle(f"sweep of {Path(report['config']).name}, {report['steps']} steps per point", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps(report, indent=2))
    (root / "sweep.md").write_text(markdown(report))
    plot(report, root / "sweep.png")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trace-mega sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a shipped config name or a YAML path")
    p.add_argument("--steps", type=int, default=5, help="training steps per point (default 5)")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the means (default 1)")
    p.add_argument("--out", default="runs/sweep", help="output directory (default runs/sweep)")
    p.add_argument("grid", nargs="+", help="KEY=V1,V2,... axes and KEY=V overrides; nproc=1,2 for processes per point")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup_steps < 0:
        p.error("--steps must be >= 1 and --warmup-steps >= 0")
    from trace_mega.config import ConfigError
    from trace_mega.resources import resolve_config

    try:
        report = run_sweep(
            str(resolve_config(args.config)),
            args.grid,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            out_dir=args.out,
        )
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"invalid sweep: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"wrote {Path(args.out) / 'sweep.md'}, sweep.json and sweep.png")
    return 0 if all(pt["exit_code"] == 0 for pt in report["points"]) else 1
