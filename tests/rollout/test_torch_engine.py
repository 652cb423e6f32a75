"""The `torch` rollout engine on a tiny random Qwen3: exactness, seeded reuse-invariance, cache hits, weight sync."""

import copy
import random

import pytest
import torch
import transformers

from trace_mega.config import RolloutConfig
from trace_mega.rollout.engines import ENGINES, EngineSetup, PrefixKVCache, SamplingParams, TorchEngine, build_engine


def tiny_qwen3(seed: int, **overrides):
    """2 layers, GQA 4/2 heads, head_dim 32; init std 0.2 so logits are peaked (no greedy near-ties)."""
    cfg = transformers.Qwen3Config(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.2,
        max_position_embeddings=512,
        **overrides,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(0)


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 6, 7, 8, 9, 10, 20, 21, 22, 23, 24], [300]]


def hf_greedy(model, prefix, n):
    out = model.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prefix) :].tolist()


def test_registry_builds_torch_engine(model):
    assert ENGINES.get("torch") is TorchEngine
    assert "vllm" in ENGINES  # vLLM itself is imported only when a VLLMEngine is constructed


def test_build_engine_runs_the_entry_launch_on_every_rank(model, tmp_path):
    written = []

    def setup(engine, host):
        return EngineSetup(
            rollout=RolloutConfig(engine=engine, enable_prefix_caching=False),
            seed=0,
            dtype="float32",
            eos_token_ids=[7],
            device=torch.device("cpu"),
            policy_config=model.config,
            checkpoint_dir=None,
            write_checkpoint=lambda d: written.append(d) or d,
            work_dir=tmp_path,
            host=host,
        )

    eng = build_engine(setup("torch", host=True))
    assert isinstance(eng, TorchEngine) and eng.eos_token_ids == [7] and not eng.enable_prefix_caching
    assert build_engine(setup("torch", host=False)) is None and written == []
    # vLLM starts from a directory: a random init is written by every rank (a collective), the
    # engine only on the hosting one.
    assert build_engine(setup("vllm", host=False)) is None and written == [tmp_path / "hf_init"]


def test_greedy_equals_transformers_generate_with_and_without_cache_hits(model):
    eng = TorchEngine(model)
    sp = SamplingParams(temperature=0, max_new_tokens=10)
    first = eng.generate(PROMPTS, sp)
    for p, c in zip(PROMPTS, first):
        assert c.token_ids == hf_greedy(model, p, 10)
        assert c.finish_reason == "length" and c.cached_prefix_tokens == 0
    # Next turn: history + generated + an "observation"; the history KV comes from the cache.
    nxt = [p + c.token_ids + [40, 41] for p, c in zip(PROMPTS, first)]
    second = eng.generate(nxt, sp)
    for p, c, prev in zip(nxt, second, first):
        assert c.token_ids == hf_greedy(model, p, 10)
        # Cached: prompt + all generated tokens but the last (whose KV was never computed).
        assert c.cached_prefix_tokens == len(p) - 2 - 1


def test_logprobs_are_raw_model_logprobs_of_sampled_tokens(model):
    eng = TorchEngine(model)
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=3)
    for p, c in zip(PROMPTS, eng.generate(PROMPTS, sp)):
        seq = torch.tensor([p + c.token_ids])
        raw = torch.log_softmax(model(seq).logits[0].float(), -1)  # temperature 1, no top-p
        ref = raw[len(p) - 1 : -1].gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def _tree_workload(eng, seed):
    """Bare rollouts (3 per prompt) then 4 continuations from each one's first turn boundary."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    bare = eng.generate(prompts, sp)
    nodes = [p + c.token_ids[:3] + [50, 51] for p, c in zip(prompts, bare)]  # turn 1 + observation
    conts = eng.generate(
        [n for n in nodes for _ in range(4)], SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed + 100)
    )
    return bare + conts, prompts + [n for n in nodes for _ in range(4)]


def test_seeded_samples_identical_with_and_without_prefix_reuse(model):
    reuse, plain, tiny_batches = (
        TorchEngine(model),
        TorchEngine(model, enable_prefix_caching=False),
        TorchEngine(model, max_batch_size=1),
    )
    a, prefixes = _tree_workload(reuse, 7)
    b, _ = _tree_workload(plain, 7)
    c, _ = _tree_workload(tiny_batches, 7)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] == [x.token_ids for x in c]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    # Different seeds give different samples (the comparison above is not vacuous).
    d, _ = _tree_workload(TorchEngine(model), 8)
    assert [x.token_ids for x in d] != [x.token_ids for x in a]
    assert all(x.cached_prefix_tokens == 0 for x in b)  # no cache: every prompt token is prefilled
    # With the cache, each request is credited at most its prefix minus the token fed for logits.
    assert all(0 <= x.cached_prefix_tokens <= len(p) - 1 for x, p in zip(a, prefixes))
    assert sum(x.cached_prefix_tokens for x in a) > 0


def test_prefill_avoided_exact_counts(model):
    eng = TorchEngine(model)
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    prompt = list(range(10, 30))  # 20 tokens
    out = eng.generate([prompt] * 5, sp)
    # One request pays the full prompt; the other four reuse 19 tokens and feed only the last.
    assert sorted(c.cached_prefix_tokens for c in out) == [0, 19, 19, 19, 19]
    # A continuation branching inside the first rollout's sequence reuses everything it shares.
    branch = prompt + out[0].token_ids[:2]
    (c,) = eng.generate([branch], sp)
    assert c.cached_prefix_tokens == len(branch) - 1


def test_stop_tokens_and_eos(model):
    greedy = hf_greedy(model, PROMPTS[0], 10)
    stop = greedy[3]
    cut = greedy.index(stop) + 1
    eng = TorchEngine(model)
    (c,) = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop]))
    assert c.token_ids == greedy[:cut] and c.finish_reason == "stop"
    # The model's EOS stops generation too.
    with_eos = copy.deepcopy(model)
    with_eos.generation_config.eos_token_id = stop
    (c,) = TorchEngine(with_eos).generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10))
    assert c.token_ids == greedy[:cut] and c.finish_reason == "stop"


def test_top_p_tiny_is_greedy(model):
    eng = TorchEngine(model)
    a = eng.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=1))
    b = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


def test_update_weights_follows_new_weights_and_clears_cache(model):
    eng = TorchEngine(copy.deepcopy(model))
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    old = eng.generate(PROMPTS, sp)
    assert len(eng.cache) > 0
    new_model = tiny_qwen3(1)
    eng.update_weights(new_model.state_dict().items())
    assert len(eng.cache) == 0 and eng.cache.tokens_held == 0
    new = eng.generate(PROMPTS, sp)
    assert all(c.cached_prefix_tokens == 0 for c in new)
    assert [c.token_ids for c in new] == [hf_greedy(new_model, p, 8) for p in PROMPTS]
    assert [c.token_ids for c in new] != [c.token_ids for c in old]
    with pytest.raises(KeyError, match="no tensor"):
        eng.update_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])


def test_engine_loads_hf_checkpoint_dir(model, tmp_path):
    model.save_pretrained(tmp_path)
    eng = TorchEngine(tmp_path)
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    assert [c.token_ids for c in eng.generate(PROMPTS, sp)] == [hf_greedy(model, p, 6) for p in PROMPTS]


def test_sleep_drops_cache(model):
    eng = TorchEngine(model)
    sp = SamplingParams(temperature=0, max_new_tokens=4)
    eng.generate([PROMPTS[2]], sp)
    eng.sleep()
    eng.wake_up()
    (c,) = eng.generate([PROMPTS[2]], sp)
    assert c.cached_prefix_tokens == 0


def _kv(n):
    return [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]


def test_prefix_cache_lru_bound_and_subsumption():
    cache = PrefixKVCache(max_tokens=10)
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))  # extends [1,2,3]: replaces it
    assert len(cache) == 1 and cache.tokens_held == 5
    cache.insert([1, 2], _kv(2))  # covered by [1..5]: nothing new stored
    assert len(cache) == 1
    cache.insert([7, 8, 9], _kv(3))
    entry, n = cache.lookup([1, 2, 3, 9])
    assert n == 3 and entry.tokens.tolist() == [1, 2, 3, 4, 5]  # now most recently used
    cache.insert([4, 4, 4, 4], _kv(4))  # 12 > 10 tokens: evicts the LRU, [7,8,9]
    assert cache.tokens_held == 9 and cache.lookup([7, 8])[1] == 0
    cache.insert(list(range(11)), _kv(11))  # larger than the whole budget: not stored
    assert cache.tokens_held == 9


class _ScanCache:
    """The prefix cache's contract as a plain scan over every stored sequence in LRU order."""

    def __init__(self, max_tokens):
        self.max_tokens, self.seqs = max_tokens, []  # least recently used first

    @staticmethod
    def _common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def lookup(self, tokens):
        best, best_len = None, 0
        for s in self.seqs:
            n = self._common(tokens, s)
            if n >= best_len and n > 0:  # ties: the most recently used
                best, best_len = s, n
        if best is not None:
            self.seqs.remove(best)
            self.seqs.append(best)
        return best, best_len

    def insert(self, tokens):
        if not tokens or len(tokens) > self.max_tokens:
            return
        for s in list(self.seqs):
            common = self._common(tokens, s)
            if common == len(tokens):
                self.seqs.remove(s)
                self.seqs.append(s)
                return
            if common == len(s):
                self.seqs.remove(s)
        self.seqs.append(list(tokens))
        while sum(map(len, self.seqs)) > self.max_tokens:
            self.seqs.pop(0)


def test_prefix_cache_equals_a_scan_over_every_sequence():
    # Random sequences over a 3-token vocabulary share prefixes, extend, cover and tie often.
    rng = random.Random(0)
    cache, ref = PrefixKVCache(max_tokens=60), _ScanCache(60)
    for _ in range(3000):
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.5:
            entry, n = cache.lookup(tokens)
            want, want_n = ref.lookup(tokens)
            assert n == want_n and (entry is None) == (want is None)
            assert entry is None or entry.tokens.tolist() == want
        else:
            cache.insert(tokens, _kv(len(tokens)))
            ref.insert(tokens)
        assert [e.tokens.tolist() for e in cache._entries.values()] == ref.seqs
        assert cache.tokens_held == sum(map(len, ref.seqs))


def test_bench_prefix_reuse_quick_runs_and_reuse_is_exact():
    from trace_mega.commands.cli import load_benchmark

    res = load_benchmark("prefix_reuse").main(["--quick", "--json", "", "--engines", "torch"])
    with_r, without = res["rows"]
    assert with_r["samples_identical"] and with_r["prompt_tokens"] == without["prompt_tokens"]
    assert without["cached_prefill_tokens"] == 0 and with_r["prefill_avoided_frac"] > 0.5


def test_update_weights_fills_fused_moe_experts_from_per_expert_names(tmp_path):
    """transformers keeps Qwen3-MoE experts fused; the learner's export (and checkpoints) name
    them per expert. A per-expert state dict makes the engine's model equal to the saved one."""
    from safetensors.torch import load_file

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in saved
    torch.manual_seed(1)
    eng = TorchEngine(transformers.AutoModelForCausalLM.from_config(cfg).eval())
    eng.update_weights(saved.items())
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    got = dict(eng.model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    with pytest.raises(KeyError, match="no tensor"):
        eng.update_weights([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(16, 32))])


def _first_token_logprobs(eng, reference16, fp32_head):
    """(engine's, reference's) log-prob of the first token sampled after each prompt alone: one prefill
    forward, the same computation as `reference16`'s decoder over the prompt; its last hidden state
    projected by the head in float32 (`fp32_head`) or in the model's dtype."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=1, seed=5)
    got, want = [], []
    for p in PROMPTS:
        c = eng.generate([p], sp)[0]
        hidden = reference16.model(torch.tensor([p])).last_hidden_state[0, -1]
        weight = reference16.get_output_embeddings().weight
        logits = hidden.float() @ weight.float().T if fp32_head else (hidden @ weight.T).float()
        got.append(c.logprobs[0])
        want.append(torch.log_softmax(logits, -1)[c.token_ids[0]].item())
    return torch.tensor(got), torch.tensor(want)


def test_fp32_head_projects_a_bfloat16_engine_hidden_state_in_float32(model):
    """`lm_head_fp32`: a bf16 engine's logits are its last hidden state times its head's weight, both
    cast to float32 (vLLM's `head_dtype`), not rounded to bf16; after `update_weights` the float32
    head follows the new weights."""
    ref16 = copy.deepcopy(model).to(torch.bfloat16)
    fp32_head = TorchEngine(copy.deepcopy(model), dtype=torch.bfloat16, lm_head_fp32=True, enable_prefix_caching=False)
    got, want = _first_token_logprobs(fp32_head, ref16, fp32_head=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    plain = TorchEngine(copy.deepcopy(model), dtype=torch.bfloat16, enable_prefix_caching=False)
    got_plain, want_plain = _first_token_logprobs(plain, ref16, fp32_head=False)
    torch.testing.assert_close(got_plain, want_plain, atol=1e-6, rtol=0)
    assert not torch.allclose(want, want_plain, atol=1e-6, rtol=0)  # the rounded logits differ
    new_model = tiny_qwen3(1)
    fp32_head.update_weights(new_model.state_dict().items())
    got, want = _first_token_logprobs(fp32_head, new_model.to(torch.bfloat16), fp32_head=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # A float32 engine has nothing to round: the option changes nothing.
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    exact, base = TorchEngine(copy.deepcopy(model), lm_head_fp32=True), TorchEngine(copy.deepcopy(model))
    assert [c.logprobs for c in exact.generate(PROMPTS, sp)] == [c.logprobs for c in base.generate(PROMPTS, sp)]
