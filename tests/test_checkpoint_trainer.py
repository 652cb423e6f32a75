"""The trainer's checkpoints end to end (megatron + gloo on CPU, one process per phase): retention with
the predictor files, resuming past a damaged newest checkpoint, and a full disk stopping the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import errno, json, logging, os, sys
import torch
from trace_mega.config import TrainConfig, load_yaml
from trace_mega.learner.checkpoint import CheckpointError
from trace_mega.trainer import Trainer
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
overrides, full_at = json.loads(sys.argv[1]), int(sys.argv[2])
trainer = Trainer(load_yaml(TrainConfig, "configs/demo_cpu.yaml", overrides))
print("START", trainer.step)
real_save = torch.save
def full_disk(obj, f, *args, **kwargs):  # the predictor file of step `full_at` does not fit
    if os.path.basename(str(f)) == f"predictor_{full_at:08d}.pt":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_save(obj, f, *args, **kwargs)
torch.save = full_disk
try:
    trainer.train()
except CheckpointError as err:
    print("STOPPED", err)
    sys.exit(3)
finally:
    trainer.close()
"""

SMALL = [
    "allocation.prompts_per_step=4",
    "allocation.root_rollouts_per_step=8",
    "allocation.rollouts_per_prompt_max=4",
    "allocation.group_size=4",
    "rollout.max_turns=2",
    "predictor.updates_per_step=1",
    "telemetry.tensorboard=false",
    "telemetry.progress_bars=false",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=1",
    "checkpoint.keep_every=2",
]


def _run(tmp_path, steps: int, full_at: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    overrides = SMALL + [f"steps={steps}", f"checkpoint.dir={tmp_path / 'ck'}", f"telemetry.out_dir={tmp_path}/run"]
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(overrides), str(full_at)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _listing(ck: Path) -> list[str]:
    return sorted(os.listdir(ck))


@pytest.mark.slow  # three short trainer runs: ~1 min on a loaded 2-core CPU
def test_retention_damaged_resume_and_full_disk(tmp_path):
    ck = tmp_path / "ck"
    # 4 steps, a checkpoint after each: keep_last=1 keeps the newest, keep_every=2 the milestones.
    first = _run(tmp_path, steps=4)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _listing(ck) == [
        "latest",
        "predictor_00000002.pt",
        "predictor_00000004.pt",
        "step_00000002",
        "step_00000004",
    ]

    # The newest checkpoint loses the end of its largest file: the run resumes from step 2.
    big = max((p for p in (ck / "step_00000004").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = big.stat().st_size
    os.truncate(big, size // 2)
    second = _run(tmp_path, steps=5)
    log = second.stdout
    assert second.returncode == 0, log[-3000:] + second.stderr[-3000:]
    rel = big.relative_to(ck).as_posix()
    assert f"WARNING checkpoint {ck / 'step_00000004'} is damaged or incomplete: {rel}: {size // 2} bytes, " in log
    assert "START 2" in log
    assert _listing(ck) == [
        "latest",
        *[f"predictor_0000000{s}.pt" for s in (2, 4, 5)],
        *[f"step_0000000{s}" for s in (2, 4, 5)],
    ]

    # The disk is full when step 6 is saved: the run stops with one error, step 5 stays latest.
    third = _run(tmp_path, steps=7, full_at=6)
    log = third.stdout
    assert third.returncode == 3, log[-3000:] + third.stderr[-3000:]
    assert "START 5" in log
    error = f"checkpoint {ck / 'step_00000006'} not written"
    assert f"ERROR {error} (OSError: [Errno 28] No space left on device); `latest` still names step_00000005" in log
    assert f"STOPPED {error}: OSError: [Errno 28] No space left on device" in log
    assert (ck / "latest").read_text() == "step_00000005"
    assert _listing(ck) == [
        "latest",
        *[f"predictor_0000000{s}.pt" for s in (2, 4, 5)],
        *[f"step_0000000{s}" for s in (2, 4, 5)],
    ]
