"""`Learner.train_step` gives the same loss, gradient norm and updates at TP=1, TP=2 and TP=2 + SP.

Each run is a real torchrun/gloo job on the same HF checkpoint (a tiny random
Qwen3 made here). A gradient counted once per TP rank (e.g. the hidden-state
gradient summed twice under sequence parallelism) shows up as a larger norm.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_mega.kernels._triton_env import env_without_interpreter

WORKER = Path(__file__).parent / "workers" / "learner_step_worker.py"


def _make_hf(tmp_path_factory, vocab):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp(f"qwen3_v{vocab}")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _make_hf(tmp_path_factory, 64)


def _run(hf_dir: Path, tmp_path: Path, tp: int, sp: bool) -> dict:
    from trace_mega.learner.parallel import free_port

    out = tmp_path / f"tp{tp}_sp{int(sp)}.json"
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(tp),
        "--master-port",
        str(free_port()),
        str(WORKER),
        str(hf_dir),
        str(out),
        str(tp),
        str(int(sp)),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_train_step_is_invariant_to_tensor_and_sequence_parallelism(hf_dir, tmp_path):
    ref = _run(hf_dir, tmp_path, 1, False)
    for tp, sp in [(2, False), (2, True)]:
        got = _run(hf_dir, tmp_path, tp, sp)
        for a, b in zip(ref["steps"], got["steps"]):
            for key in ("loss/total", "loss/grad_norm", "loss/token_entropy", "loss/units"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (tp, sp, key)
        assert got["hidden_sum"] == pytest.approx(ref["hidden_sum"], rel=1e-4, abs=1e-3)
        assert got["hidden_abs"] == pytest.approx(ref["hidden_abs"], rel=1e-4)
    assert ref["steps"][0]["loss/grad_norm"] > 0
    assert ref["chunk_diff"] < 1e-5  # hidden states computed tree by tree == all at once
    for run in (ref, got):  # the training forward leaves the same hidden states for the predictor
        assert run["train_hidden_diff"] < 1e-5


@pytest.mark.slow
def test_train_step_with_a_vocab_not_divisible_by_tp_matches_tp1(tmp_path_factory, tmp_path):
    """Vocab 97 at TP = 2 is padded to 98: the padding row must not enter the training log-softmax."""
    odd = _make_hf(tmp_path_factory, 97)
    ref = _run(odd, tmp_path, 1, False)
    got = _run(odd, tmp_path, 2, False)
    for a, b in zip(ref["steps"], got["steps"]):
        for key in ("loss/total", "loss/grad_norm", "loss/token_entropy", "loss/logprob_mismatch"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
