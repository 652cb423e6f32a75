"""What a `trace-mega train` run shows and writes: a quiet console, the full log file,
periodic validation in the metrics rows, and a W&B run (offline) with the JSONL's names.

One real 2-step CPU run (megatron + gloo) in a subprocess serves the quiet-console,
log-file, validation and W&B checks; a 1-step `--verbose` run the verbose check.
"""

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "allocation.prompts_per_step=8",
    "allocation.root_rollouts_per_step=12",
    "rollout.max_turns=4",
    "telemetry.tensorboard=false",
]
# Library output that belongs in the log file only (megatron-core 0.16.1 on CPU).
NOISE = [
    "OptimizerConfig(",
    "DistributedDataParallelConfig(",
    "Params for bucket",
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
]


def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "trace_mega", "train", *args, *SMALL, f"telemetry.out_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quiet")
    proc = _train(
        out,
        "--config",
        "demo_cpu",
        "steps=2",
        "eval.every_steps=2",
        "eval.max_tasks=4",
        "eval.samples_per_task=4",
        "telemetry.wandb_project=trace-mega-test",
        "telemetry.wandb_mode=offline",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, proc.stdout + proc.stderr, rows


@pytest.mark.slow
def test_console_shows_step_lines_and_no_library_dumps(run):
    _, console, _ = run
    assert "step    0 |" in console and "step    1 |" in console and "test pass@1" in console
    for text in NOISE:
        assert text not in console, text
    assert len(console) < 4000, console  # the step lines, the bar and a few notes


@pytest.mark.slow
def test_log_file_has_everything(run):
    out, _, _ = run
    log = (out / "train.log").read_text()
    for text in NOISE + ["step    0 |", "INFO megatron.core.optimizer"]:
        assert text in log, text


@pytest.mark.slow
def test_periodic_validation_is_in_the_step_rows(run):
    out, _, rows = run
    assert [r["step"] for r in rows] == [0, 1]
    assert "eval/test/pass@1" not in rows[0]  # every 2 steps: after the second only
    val = rows[1]
    for key in ("eval/test/pass@1", "eval/test/pass@2", "eval/test/pass@4", "eval/test/mean@4", "eval/test/tasks"):
        assert key in val, key
    assert 0.0 <= val["eval/test/pass@1"] <= val["eval/test/pass@2"] <= val["eval/test/pass@4"] <= 1.0
    assert val["eval/test/tasks"] == 4.0 and val["eval/test/reward"] == val["eval/test/mean@4"]
    report = json.loads((out / "eval" / "step_00000002.json").read_text())
    assert report["n"] == 4 and len(report["tasks"]) == 4 and all(len(t["rewards"]) == 4 for t in report["tasks"])
    assert "| **all** | 4 |" in (out / "eval" / "step_00000002.md").read_text()


def _wandb_records(path: Path) -> list[bytes]:
    """Payloads of a W&B transaction log (.wandb): a 7-byte header (":W&B", magic, version), then
    LevelDB-log records (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) in
    32 KiB blocks."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, out, part = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF == crc
        pos += 7 + length
        part += payload
        if kind in (1, 4):
            out.append(part)
            part = b""
    return out


@pytest.mark.slow
def test_wandb_offline_run_logs_the_jsonl_metrics_by_name(run):
    from wandb.proto import wandb_internal_pb2 as pb

    out, _, rows = run
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for payload in _wandb_records(log):
        rec = pb.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.append(items)
    assert len(history) == len(rows) == 2
    for row, hist in zip(rows, history):
        assert hist["_step"] == row["step"]
        logged = {k: v for k, v in hist.items() if not k.startswith("_")}
        assert set(logged) == set(row) - {"step"}
        assert all(logged[k] == pytest.approx(row[k], nan_ok=True) for k in logged), logged


@pytest.mark.slow
def test_verbose_console_shows_library_logs(tmp_path):
    proc = _train(tmp_path, "--verbose", "--config", "demo_cpu", "steps=1")
    console = proc.stdout + proc.stderr
    assert "OptimizerConfig(" in console and "Apex is not installed" in console and "step    0 |" in console


def test_console_filter():
    import logging

    from trace_mega.logs import ConsoleFilter

    def rec(name, level):
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    quiet, verbose, rank1 = ConsoleFilter(False), ConsoleFilter(True), ConsoleFilter(False, rank=1)
    assert quiet.filter(rec("trace_mega", logging.INFO)) and quiet.filter(rec("trace_mega.warnings", logging.WARNING))
    assert not quiet.filter(rec("megatron.core.optimizer", logging.INFO))
    assert not quiet.filter(rec("py.warnings", logging.WARNING))  # libraries' warnings.warn
    assert quiet.filter(rec("transformers.modeling_utils", logging.WARNING))
    assert quiet.filter(rec("megatron.core", logging.ERROR))
    assert verbose.filter(rec("megatron.core.optimizer", logging.INFO)) and verbose.filter(
        rec("py.warnings", logging.WARNING)
    )
    assert not rank1.filter(rec("trace_mega", logging.INFO)) and rank1.filter(rec("trace_mega", logging.WARNING))
    assert not rank1.filter(rec("vllm.engine", logging.WARNING)) and rank1.filter(rec("vllm.engine", logging.ERROR))


def test_the_step_line_shows_the_unreplayed_mismatch_only_when_the_probe_ran(tmp_path):
    from trace_mega.telemetry import MetricsSink

    sink = MetricsSink(tmp_path, tensorboard=False, enabled=False)
    plain = sink.log(3, {"reward/mean": 0.5, "mismatch/k3": 2e-5})
    probed = sink.log(3, {"reward/mean": 0.5, "mismatch/k3": 2e-5, "moe/own_routing_k3": 3e-5})
    assert "mismatch 2.0e-05" in plain and "unreplayed" not in plain
    assert "mismatch 2.0e-05 | unreplayed 3.0e-05" in probed
