"""`rollout.lm_head_fp32` through vLLM: its `head_dtype` override (`hf_overrides`) reaches the logits
processor of a bfloat16 engine. Run by .ci/vllm_stage.sh in .venv-vllm; skipped where vLLM is not importable.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
import transformers  # noqa: E402

from trace_mega.rollout.engines import SamplingParams, VLLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Qwen3 (head_dim 32: vLLM on CPU refuses 16), as an HF directory and the model."""
    cfg = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.1,
        max_position_embeddings=256,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("qwen3_fp32_head")
    model.save_pretrained(path)
    return path, model


def test_bfloat16_engine_runs_its_head_in_float32(policy):
    path, model = policy
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    eng = VLLMEngine(path, dtype="bfloat16", max_model_len=256, max_num_seqs=4, lm_head_fp32=True)
    try:
        assert eng.llm.apply_model(lambda m: m.logits_processor.head_dtype) == [torch.float32]
        prompt = [5, 6, 7, 8, 9, 10]
        out = eng.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=1, seed=3))[0]
        # The reference: transformers' bf16 decoder, its last hidden state through the head in float32.
        m16 = model.to(torch.bfloat16)
        with torch.no_grad():
            hidden = m16.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        logits = hidden.float() @ m16.get_output_embeddings().weight.float().T
        ref = torch.log_softmax(logits, -1)[out.token_ids[0]].item()
        assert abs(out.logprobs[0] - ref) < 0.05  # vLLM's CPU kernels round the bf16 decoder differently
    finally:
        eng.close()


def test_a_vllm_that_ignores_head_dtype_fails_at_start_up(policy, monkeypatch):
    """A vLLM whose logits processor has no `head_dtype` (before vLLM honoured it for generation models)
    accepts the override and projects in bf16: the engine refuses to start, naming the field. The
    installed vLLM's processor is stripped of the attribute to stand for such a version."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    init = LogitsProcessor.__init__

    def old_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.head_dtype = None  # what a vLLM without generation-model head_dtype leaves in force

    monkeypatch.setattr(LogitsProcessor, "__init__", old_init)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(RuntimeError, match="rollout.lm_head_fp32"):
        VLLMEngine(policy[0], dtype="bfloat16", max_model_len=256, max_num_seqs=4, lm_head_fp32=True)
