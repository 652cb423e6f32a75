"""Stopping cleanly at a step boundary (trace_mega/stopping.py, docs/operations.md): an exit signal
under torchrun DP = 2 through the SLURM launcher, the wall-clock limit, and a run of skipped steps."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
from test_trainer import CONFIG, ROOT, SMALL, _env, _rows, _train, kill_once_two_steps_logged
from test_trainer_replicas import _torchrun

from trace_mega.learner.parallel import free_port
from trace_mega.stopping import REQUEUE_EXIT_CODE, SKIPPED_EXIT_CODE

# Rewards from step 0 and the predictor planning every step (no fallback), so the predictor's state
# (its optimiser and replay window, checkpointed per rank) decides the allocation after the resume.
RUN = [
    "steps=8",
    "env.name=synthetic",
    "env.options={num_tasks: 16}",
    "allocation.name=trace",
    "allocation.predictor_fallback=false",
    "checkpoint.every_steps=100",  # only the stop (and the last step) checkpoint
]


def _timing(key: str) -> bool:
    """Wall-clock figures (seconds, shares of time): they differ from run to run."""
    return key.startswith(("time/", "gpu/", "perf/")) or key.endswith(("_s", "_seconds_max", "_busy_frac"))


def assert_same_rows(ref: list[dict], rows: list[dict]) -> None:
    """Every metric but the timings equal: exactly, or to float noise (the engine's and the learner's
    log-probs differ by ~1e-7 from run to run, `loss/logprob_mismatch`)."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    bad = []
    for a, b in zip(ref, rows):
        assert set(a) == set(b), set(a) ^ set(b)
        for k, v in a.items():
            w = b[k]
            same = v == w or (math.isnan(v) and math.isnan(w)) or math.isclose(v, w, rel_tol=1e-5, abs_tol=1e-6)
            if not _timing(k) and not same:
                bad.append((a["step"], k, v, w))
    assert not bad, bad


@pytest.mark.slow
def test_sigusr1_under_dp2_checkpoints_exits_for_a_requeue_and_resumes_as_if_never_stopped(tmp_path):
    """SIGUSR1 to the SLURM launcher (as train.sbatch passes it on) while step 2 is in flight: both
    ranks finish a step, checkpoint it and the launcher exits 75; rerun, the resumed DP = 2 run logs
    what an uninterrupted DP = 2 run logs, step by step."""
    ref = _torchrun(tmp_path / "ref", *RUN, f"checkpoint.dir={tmp_path / 'ck_ref'}")
    assert sum(r["reward/mean"] for r in ref) > 0 and all(r["loss/skipped"] == 0 for r in ref)
    out, ck = tmp_path / "run", tmp_path / "ck"
    slurm = {"SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "1"}
    cmd = [
        *(sys.executable, "-m", "trace_mega.commands.launch", "--nproc-per-node", "2", "--port", str(free_port())),
        *("--", "train", "--config", str(CONFIG), *SMALL, f"telemetry.out_dir={out}", f"checkpoint.dir={ck}", *RUN),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env() | slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        kill_once_two_steps_logged(proc, out, lambda: proc.send_signal(signal.SIGUSR1))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = proc.stdout.read().decode()
    assert proc.returncode == REQUEUE_EXIT_CODE, log[-4000:]
    stopped = _rows(out)[-1]["step"]
    assert 2 <= stopped < 7 and f"stopped after step {stopped}: SIGUSR1" in log
    assert (ck / "latest").read_text() == f"step_{stopped + 1:08d}"
    rows = _torchrun(out, *RUN, f"checkpoint.dir={ck}")  # the rerun resumes
    assert_same_rows(ref, rows)


@pytest.mark.slow
def test_the_wall_clock_limit_stops_after_a_checkpoint_and_a_rerun_finishes(tmp_path):
    """`checkpoint.exit_after_minutes` below one step: the first step ends the process (75) with its
    checkpoint; the rerun resumes from it and completes the run."""
    ck = tmp_path / "ck"
    args = ("steps=2", f"checkpoint.dir={ck}", "checkpoint.exit_after_minutes=0.0001")
    cmd = [sys.executable, "-m", "trace_mega", "train", "--config", str(CONFIG), *SMALL, *args]
    run = [*cmd, f"telemetry.out_dir={tmp_path / 'run'}"]
    proc = subprocess.run(run, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr[-3000:]
    assert "stopped after step 0: checkpoint.exit_after_minutes=0.0001 reached" in proc.stderr
    assert (ck / "latest").read_text() == "step_00000001" and [r["step"] for r in _rows(tmp_path / "run")] == [0]
    # The limit counts from the start of each process: one step per process, then the last step ends the run.
    proc = subprocess.run(run, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1] and (ck / "latest").read_text() == "step_00000002"


# Non-finite advantages from the second step on: every later loss is NaN, so every later update
# must be skipped.
POISON = """
import dataclasses, sys, torch
import trace_mega.trainer as trainer
real, calls = trainer.compute_advantages, []
def poisoned(*args):
    calls.append(1)
    adv = real(*args)
    nan = torch.full_like(adv.advantages, float("nan"))
    return adv if len(calls) == 1 else dataclasses.replace(adv, advantages=nan)
trainer.compute_advantages = poisoned
from trace_mega.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _train_patched(script: str, *args: str) -> subprocess.CompletedProcess:
    """`trace-mega train` on the small config through `script` (which patches the trainer first)."""
    cmd = [sys.executable, "-c", script, "train", "--config", str(CONFIG), *SMALL, *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_consecutive_skipped_steps_stop_the_run_with_a_checkpoint_naming_the_step_and_metric(tmp_path):
    out, ck = tmp_path / "run", tmp_path / "ck"
    args = ["steps=8", "optim.max_consecutive_skipped=3", f"checkpoint.dir={ck}", f"telemetry.out_dir={out}"]
    proc = _train_patched(POISON, *args)
    assert proc.returncode == SKIPPED_EXIT_CODE, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["loss/skipped"] for r in rows] == [0, 1, 1, 1]
    assert all(math.isnan(r["loss/total"]) for r in rows[1:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped after step 3: 3 steps in a row updated nothing (optim.max_consecutive_skipped=3)")
    assert "step 3: loss/total = nan" in last
    assert (ck / "latest").read_text() == "step_00000004"
    # A skipped step does not advance the learning-rate schedule either (warm-up: it would move).
    assert len({r["loss/lr"] for r in rows[1:]}) == 1 and rows[0]["loss/lr"] != rows[1]["loss/lr"]


# TRACE-C's probe broken from the second step on: every boundary's value is NaN.
BROKEN_PROBE = """
import sys, torch
import trace_mega.trainer as trainer
real = trainer.Trainer._probe
def probe(self, batch):
    ell = real(self, batch)
    return ell if batch.step == 0 else torch.full_like(ell, float("nan"))
trainer.Trainer._probe = probe
from trace_mega.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_non_finite_probe_values_skip_the_update_and_are_named(tmp_path):
    """NaN probe values at real boundaries (NaN is also the probe's "no boundary" mark, so they would
    read as zero credit) skip the step's update; two such steps stop the run naming the probe."""
    out = tmp_path / "run"
    credit = ["credit.enabled=true", "credit.answer_template=goal", "optim.max_consecutive_skipped=2"]
    proc = _train_patched(BROKEN_PROBE, *credit, "steps=5", f"telemetry.out_dir={out}")
    assert proc.returncode == SKIPPED_EXIT_CODE, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["loss/skipped"] for r in rows] == [0, 1, 1]
    assert rows[0]["credit/probe_nonfinite"] == 0 and rows[1]["credit/probe_nonfinite"] > 0
    assert "step 2: credit/probe_nonfinite = " in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_resume_brings_back_the_predictors_optimiser_and_replay_window(tmp_path):
    """One process, stopped by the clock after step 0 and resumed: the rest logs what an uninterrupted
    run logs (the predictor's Adam moments and replay window come back with the checkpoint, and the
    prompt memory: steps 2 and 3 revisit step 0's prompts, 16 tasks at 8 a step)."""
    run = [*RUN[1:], "steps=4", "predictor.memory_prior_rollouts=4"]
    ref = _train(tmp_path / "ref", *run)
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    cmd = [sys.executable, "-m", "trace_mega", "train", "--config", str(CONFIG), *SMALL, *run, ck]
    cmd += [f"telemetry.out_dir={tmp_path / 'run'}"]
    first = subprocess.run([*cmd, "checkpoint.exit_after_minutes=0.0001"], cwd=ROOT, env=_env(), capture_output=True)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-3000:]
    rest = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_same_rows(ref, _rows(tmp_path / "run"))
    assert json.loads((tmp_path / "ck" / "step_00000004" / "trainer_state.json").read_text())["trainer_step"] == 4
