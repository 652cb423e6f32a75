"""The trainer from an HF checkpoint directory on a real tool environment.

A tiny random Qwen3 and a byte-level Qwen3-style tokenizer (both made here)
are saved together as the checkpoint that `model.hf_checkpoint` names: the
architecture comes from its config.json, the weights through the HF → Megatron
converter, the tokenizer and chat template through `AutoTokenizer`. One step on
`multihop_qa` (bm25s search over the shipped corpus) with TRACE-C credit on the
gold answers, and one on `math_python` (sandboxed interpreter).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_mega.kernels._triton_env import env_without_interpreter

ROOT = Path(__file__).resolve().parent.parent


def _tokenizer():
    spec = importlib.util.spec_from_file_location(
        "bfcl_replay_engine", ROOT / "tests" / "envs" / "bfcl_replay_engine.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qwen3_style_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("qwen3_tiny")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _train(checkpoint, out, *overrides):
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "train",
        "--config",
        str(ROOT / "configs" / "demo_cpu.yaml"),
        "steps=1",
        f"model.hf_checkpoint={checkpoint}",
        "allocation.prompts_per_step=4",
        "allocation.root_rollouts_per_step=6",
        "rollout.max_turns=3",
        "rollout.max_new_tokens_per_turn=24",
        "rollout.max_total_tokens=3072",
        "parallel.micro_batch_tokens=4096",
        "telemetry.tensorboard=false",
        "telemetry.progress_bars=false",
        f"telemetry.out_dir={out}",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_multihop_qa_from_an_hf_checkpoint_with_trace_c(checkpoint, tmp_path):
    (row,) = _train(checkpoint, tmp_path, "env.name=multihop_qa", "env.options={}", "credit.enabled=true")
    assert row["loss/skipped"] == 0.0 and row["time/credit_s"] > 0.0
    assert row["rollout/generated_tokens"] > 0 and row["alloc/trajectories"] > 0
    # A random byte-level policy writes garbage: it must come back as error observations.
    assert row["rollout/parse_errors"] > 0
    assert row["loss/logprob_mismatch"] < 1e-3  # the engine runs the converted learner weights


@pytest.mark.slow
def test_math_python_from_an_hf_checkpoint(checkpoint, tmp_path):
    (row,) = _train(checkpoint, tmp_path, "env.name=math_python", "env.options={}", "allocation.name=uniform")
    assert row["loss/skipped"] == 0.0 and row["alloc/trajectories"] == 12
