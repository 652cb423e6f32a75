"""Rollout replicas in the trainer: a DP = 2 torchrun run equals the DP = 1 run step by step.

The demo config on the `synthetic` environment (its random policy earns rewards from step 0,
so advantages and losses are non-zero and the comparison can fail), shrunk to two steps."""

import math
import subprocess
import sys

import pytest
from test_trainer import CONFIG, ROOT, SMALL, _env, _rows, _train, kill_once_two_steps_logged

from trace_mega.learner.parallel import free_port

# The guard keeps an unmeasured predictor off the first steps; off here, so both steps plan with
# the predictor's (DP-split) scores.
RUN = ["steps=2", "env.name=synthetic", "env.options={num_tasks: 16}", "allocation.predictor_fallback=false"]
EXACT = (
    "alloc/",
    "reward/",
    "data/",
    "rollout/generated_tokens",
    "rollout/truncated",
    "rollout/tool_calls",
    "rollout/parse_errors",
    "rollout/turns_per_episode",
    "loss/units",
    "loss/optimizer_steps",
    "predictor/samples",
)


# Differences of two nearly equal log-prob streams (engine vs learner, policy vs reference): their
# float noise (~1e-7) is not relative to their size, so they are compared absolutely.
DIFFERENCES = ("loss/logprob_mismatch", "loss/kl_ref", "loss/approx_kl")


def _torchrun(out, *overrides, env=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(CONFIG),
        *SMALL,
        f"telemetry.out_dir={out}",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _rows(out)


def _close(a: float, b: float, rel: float, abs_: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


# TRACE-C on the demo's own environment: the probe's process rewards make the loss non-zero
# even before any episode succeeds (its random policy earns no reward in two steps).
CREDIT = ["steps=2", "credit.enabled=true", "credit.answer_template=goal", "loss.kl_coef=0.01"]


def assert_same_run(one: list[dict], two: list[dict], replicas: int) -> None:
    """`two` (run on `replicas` replicas) logs what the single-replica run `one` logs: allocation,
    reward, data and count figures exactly, losses to 1e-5 relative (see DIFFERENCES)."""
    bad = []
    for a, b in zip(one, two):
        assert a["rollout/replicas_generating"] == 1 and b["rollout/replicas_generating"] == replicas
        assert b["rollout/replica_trajectories_min"] > 0
        if replicas > 1:  # every replica took a share, none took it all
            assert (
                b["rollout/replica_trajectories_min"] + b["rollout/replica_trajectories_max"] <= a["alloc/trajectories"]
            )
        for k, v in a.items():
            if k.startswith(EXACT):
                ok = b[k] == v or (v != v and b[k] != b[k])
            elif k in DIFFERENCES:
                ok = abs(b[k] - v) < 1e-6
            elif k.startswith(("loss/", "memory/")):  # memory/: its Brier scores read the predictions
                ok = _close(v, b[k], 1e-5, 1e-9)
            elif k.startswith("credit/"):
                ok = _close(v, b[k], 1e-4, 1e-7)
            elif k.startswith("predictor/"):
                # Each DP rank fits on its share and the gradients are summed, so the sums run in
                # another order; under the anchor (`anchor_at_mean`) the bias's first gradient is 0
                # up to that rounding (~1e-9) and Adam turns it into a step of ~0.1 lr either way.
                # The split itself is exact (tests/predictor: shares == one process to 1e-5).
                ok = _close(v, b[k], 0.1, 1e-3)
            else:
                continue
            if not ok:
                bad.append((a["step"], k, v, b[k]))
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize(
    "run",
    [
        # Steps 0 and 1 plan as trace without the memory (it knows none of their prompts); step 2
        # revisits step 0's prompts (16 tasks, 8 a step), so the prompt memory plans it.
        [*RUN, "allocation.name=trace", "predictor.memory_prior_rollouts=4", "steps=3"],
        [*RUN, "allocation.name=trace_global"],
        CREDIT,
    ],
    ids=["trace_and_prompt_memory", "trace_global", "trace_c_probe"],
)
def test_dp2_equals_dp1(tmp_path, run):
    one = _train(tmp_path / "dp1", *run)
    two = _torchrun(tmp_path / "dp2", *run)
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(len(one))) and len(one) >= 2
    assert all(r.get("memory/known_fraction", 0) == 0 for r in one[:2])  # nothing to remember yet
    assert all(r["memory/known_fraction"] > 0 for r in one[2:])  # the memory planned step 2
    assert any(r["loss/total"] != 0 for r in one)  # not a trivial run
    assert run is CREDIT or sum(r["reward/mean"] for r in one) > 0
    assert_same_run(one, two, replicas=2)


# Every no-grad pass (predictions, the probe, reference and old log-probs) and the update
# through two pipeline stages: two mini-batches make the old-log-prob forward run.
PIPELINE = [
    *RUN,
    "allocation.name=trace",
    "credit.enabled=true",
    "credit.answer_template=goal",
    "loss.kl_coef=0.01",
    "optim.mini_batches_per_step=2",
]


@pytest.mark.slow
def test_pp2_equals_pp1(tmp_path):
    """Two pipeline stages (one replica spanning both ranks, weights synced from both stages)
    log what one process logs. Both start from one HF export: megatron seeds each stage's
    initialisation by its PP rank, so fresh PP = 1 and PP = 2 networks differ."""
    _train(tmp_path / "init", *RUN[1:], "steps=0", "checkpoint.export_hf_at_end=true")
    init = f"model.hf_checkpoint={tmp_path / 'init' / 'hf'}"
    one = _train(tmp_path / "pp1", *PIPELINE, init)
    two = _torchrun(tmp_path / "pp2", *PIPELINE, init, "parallel.pipeline_model_parallel_size=2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1]
    assert all(r["loss/optimizer_steps"] == 2 for r in one) and sum(r["reward/mean"] for r in one) > 0
    assert any(r["loss/kl_ref"] > 0 for r in one)  # the reference's log-probs were read
    # The probe's values enter every advantage (TRACE-C), hence the losses compared below.
    assert_same_run(one, two, replicas=1)


@pytest.mark.slow
def test_sigkill_mid_step_under_dp2_resumes_with_the_same_data_order(tmp_path):
    """Kill a DP = 2 run (the whole process group) while step 2 is in flight; the resumed DP = 2 run
    logs the same prompts and rewards as an uninterrupted DP = 1 run."""
    import os
    import signal

    steps = ["steps=4", "checkpoint.every_steps=1"]
    ref = _train(tmp_path / "ref", *steps, f"checkpoint.dir={tmp_path / 'ck_ref'}")
    out, ck = tmp_path / "run", tmp_path / "ck"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(CONFIG),
        *SMALL,
        *steps,
        f"telemetry.out_dir={out}",
        f"checkpoint.dir={ck}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    kill_once_two_steps_logged(proc, out, lambda: os.killpg(proc.pid, signal.SIGKILL))  # torchrun and both ranks
    rows = _torchrun(out, *steps, f"checkpoint.dir={ck}")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["data/prompt_hash"] for r in rows] == [r["data/prompt_hash"] for r in ref]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref]
    assert [r["alloc/trajectories"] for r in rows] == [r["alloc/trajectories"] for r in ref]
