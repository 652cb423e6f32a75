"""Rollout replicas in the trainer: a DP = 2 torchrun run equals the DP = 1 run step by step.

The demo config on the `synthetic` environment (its random policy earns rewards from step 0,
so advantages and losses are non-zero and the comparison can fail), shrunk to two steps."""
import math
import subprocess
import sys

import pytest
from test_trainer import CONFIG, ROOT, SMALL, _env, _rows, _train

from trace_mega.learner.parallel import free_port

RUN = ["steps=2", "env.name=synthetic", "env.options={num_tasks: 16}"]
EXACT = ("alloc/", "reward/", "data/", "rollout/generated_tokens", "rollout/truncated", "rollout/tool_calls",
         "rollout/parse_errors", "rollout/turns_per_episode", "loss/units", "loss/optimizer_steps", "predictor/samples")


def _torchrun(out, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "trace_mega.cli", "train", "--config", str(CONFIG), *SMALL, f"telemetry.out_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _rows(out)


def _close(a: float, b: float, rel: float, abs_: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.mark.slow
@pytest.mark.parametrize("allocator", ["trace", "trace_global"])
def test_dp2_equals_dp1(tmp_path, allocator):
    one = _train(tmp_path / "dp1", *RUN, f"allocation.name={allocator}")
    two = _torchrun(tmp_path / "dp2", *RUN, f"allocation.name={allocator}")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1]
    assert sum(r["reward/mean"] for r in one) > 0 and any(r["loss/total"] != 0 for r in one)  # not a trivial run
    for a, b in zip(one, two):
        assert a["rollout/replicas_generating"] == 1 and b["rollout/replicas_generating"] == 2
        assert b["rollout/replica_trajectories_min"] > 0
        assert b["rollout/replica_trajectories_min"] + b["rollout/replica_trajectories_max"] <= a["alloc/trajectories"]
        for k, v in a.items():
            if k.startswith(EXACT):
                assert b[k] == v or (v != v and b[k] != b[k]), (a["step"], k, v, b[k])
            elif k == "loss/logprob_mismatch":  # float noise of two forwards (~1e-7), not a loss
                assert abs(b[k] - v) < 1e-6, (k, v, b[k])
            elif k.startswith("loss/"):
                assert _close(v, b[k], 1e-5, 1e-9), (a["step"], k, v, b[k])
            elif k.startswith("predictor/"):
                assert _close(v, b[k], 1e-4, 1e-7), (a["step"], k, v, b[k])
