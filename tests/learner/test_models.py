"""In-process unit tests: the tree mask, the TreeCoreAttention leaf (sdpa, tree_triton) and HF config mapping.

Full-model behaviour (RoPE at tree positions, parity with transformers, TP/PP/EP)
runs in torchrun workers: tests/learner/test_convert.py and test_parallel.py.
"""

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from workers.common import packed_tree, path_indices, tree_paths

from trace_mega.learner.models import model_config_from_hf, padded_vocab_size
from trace_mega.ops.attention import TreeCoreAttention, tree_attention_mask, tree_mask_dense


@pytest.fixture(scope="module")
def tp1_group():
    """A single-rank gloo group: the leaf's TP group when TP = 1."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def _leaf(group, backend, heads=4, groups=2, head_dim=16):
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return TreeCoreAttention(
        cfg, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection(tp=group), backend=backend
    )


def _reference(q, k, v, allowed):
    """Plain softmax attention, (S, B, H, D) inputs, allowed (B, S, S) -> (S, B, H*D)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def test_tree_mask_is_the_packing_rule():
    t = packed_tree(seed=0)
    node, exit_ = t["token_node"][0], t["token_node_exit"][0]
    dense = tree_mask_dense(tree_attention_mask(node, exit_))[0, 0]
    T = node.numel()
    for i in range(T):
        for j in range(T):
            assert bool(dense[i, j]) == bool(node[j] <= node[i] <= exit_[j] and j <= i), (i, j)
    # Each token sees exactly its own root-to-token path.
    for path in tree_paths():
        idx = path_indices(t, path)
        for pos, i in enumerate(idx):
            assert torch.equal(torch.nonzero(dense[i]).flatten(), idx[: pos + 1].sort().values)
    zeros = torch.zeros(1, 7, dtype=torch.long)
    assert torch.equal(
        tree_mask_dense(tree_attention_mask(zeros, zeros))[0, 0], torch.ones(7, 7, dtype=torch.bool).tril()
    )


def test_sdpa_leaf_matches_reference_with_gqa_and_grads(tp1_group):
    t = packed_tree(seed=1)
    S = t["input_ids"].shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, 1, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(S, 1, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(S, 1, 2, 16, generator=g, requires_grad=True)
    mask = tree_attention_mask(t["token_node"], t["token_node_exit"])
    leaf = _leaf(tp1_group, "sdpa")
    out = leaf(q, k, v, mask)
    ref = _reference(q, k, v, tree_mask_dense(mask)[:, 0])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    causal = leaf(q, k, v, None)
    torch.testing.assert_close(
        causal, _reference(q, k, v, torch.ones(1, S, S, dtype=torch.bool).tril()), atol=1e-5, rtol=1e-5
    )


def test_leaf_rejects_dense_masks(tp1_group):
    q = torch.randn(4, 1, 4, 16)
    kv = torch.randn(4, 1, 2, 16)
    with pytest.raises(TypeError, match="tree mask"):
        _leaf(tp1_group, "sdpa")(q, kv, kv, torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_tree_triton_backend_matches_sdpa(tp1_group):
    t = packed_tree(seed=2)
    S = t["input_ids"].shape[1]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(S, 1, h, 16, generator=g) for h in (4, 2, 2))
    mask = tree_attention_mask(t["token_node"], t["token_node_exit"])
    want = _leaf(tp1_group, "sdpa")(q, k, v, mask)
    got = _leaf(tp1_group, "tree_triton")(q, k, v, mask)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_model_config_from_hf_families():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    small = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    q3 = model_config_from_hf(Qwen3Config(**small, head_dim=32, tie_word_embeddings=True))
    assert (q3.head_dim, q3.qk_layernorm, q3.qkv_bias, q3.tie_word_embeddings, q3.num_experts) == (
        32,
        True,
        False,
        True,
        None,
    )
    q2 = model_config_from_hf(Qwen2Config(**small))
    assert (q2.head_dim, q2.qk_layernorm, q2.qkv_bias) == (16, False, True)
    ll = model_config_from_hf(LlamaConfig(**small, rope_theta=500000.0))
    assert (ll.qk_layernorm, ll.qkv_bias, ll.rotary_base, ll.num_query_groups) == (False, False, 500000.0, 2)
    moe = model_config_from_hf(
        Qwen3MoeConfig(**small, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    )
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.moe_norm_topk_prob) == (8, 2, 32, False)
    with pytest.raises(ValueError, match="rope type"):
        model_config_from_hf(
            LlamaConfig(
                **small,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        )


def test_vocab_padding():
    assert [padded_vocab_size(v, tp) for v, tp in [(128, 2), (129, 2), (151936, 8), (7, 4)]] == [128, 130, 151936, 8]


def _small(**kw):
    return dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **kw,
    )


@pytest.mark.parametrize(
    "hf_act,ours",
    [
        ("silu", "silu"),
        ("gelu", "gelu"),
        ("gelu_pytorch_tanh", "gelu_tanh"),
        ("gelu_new", "gelu_tanh"),
        ("relu", "relu"),
    ],
)
def test_hidden_act_maps_to_the_same_function(hf_act, ours):
    from transformers import LlamaConfig
    from transformers.activations import ACT2FN

    from trace_mega.config import ParallelConfig
    from trace_mega.learner.models import ACTIVATIONS, transformer_config

    mc = model_config_from_hf(LlamaConfig(**_small(hidden_act=hf_act)))
    assert mc.activation == ours
    fn = transformer_config(mc, ParallelConfig(device="cpu"), torch.device("cpu")).activation_func
    x = torch.linspace(-6, 6, 1001)
    assert fn is ACTIVATIONS[ours]
    torch.testing.assert_close(fn(x), ACT2FN[hf_act](x), atol=1e-6, rtol=0)  # gelu_new: same formula, other op order


def test_unsupported_hidden_act_is_refused_naming_the_field():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="hidden_act='quick_gelu'"):
        model_config_from_hf(LlamaConfig(**_small(hidden_act="quick_gelu")))


def test_sliding_window_attention_is_refused_naming_the_field():
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    with pytest.raises(ValueError, match=r"layer_types .*layers \[2, 3\].*sliding_window=64"):
        model_config_from_hf(Qwen2Config(**_small(use_sliding_window=True, sliding_window=64, max_window_layers=2)))
    with pytest.raises(ValueError, match="layer_types"):
        model_config_from_hf(
            Qwen3Config(
                **_small(
                    layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=32, use_sliding_window=True
                )
            )
        )
    with pytest.raises(ValueError, match="use_sliding_window"):
        model_config_from_hf(
            Qwen3MoeConfig(
                **_small(
                    use_sliding_window=True,
                    sliding_window=64,
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=32,
                )
            )
        )
    # exact cases convert: the flag off (Qwen2.5's shipped configs: the window is then None), or a window
    # no sequence reaches
    model_config_from_hf(
        Qwen3Config(**_small(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=32))
    )
    model_config_from_hf(Qwen2Config(**_small(use_sliding_window=False, sliding_window=64, max_window_layers=2)))
    model_config_from_hf(Qwen2Config(**_small(use_sliding_window=True, sliding_window=256, max_window_layers=2)))


def test_qwen3_moe_top1_router_settings():
    from transformers import Qwen3MoeConfig

    from trace_mega.config import ConfigError, ModelConfig, ParallelConfig, load_config
    from trace_mega.learner.models import transformer_config

    moe = dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with norm_topk_prob=true"):
        model_config_from_hf(Qwen3MoeConfig(**_small(**moe, norm_topk_prob=True)))
    mc = model_config_from_hf(Qwen3MoeConfig(**_small(**moe, norm_topk_prob=False)))
    tc = transformer_config(mc, ParallelConfig(device="cpu"), torch.device("cpu"))
    assert (tc.moe_router_topk, tc.moe_router_pre_softmax) == (1, True)  # HF: softmax over all, then top-1
    with pytest.raises(ConfigError, match="moe_norm_topk_prob"):
        load_config(ModelConfig, {"num_experts": 4, "moe_router_topk": 1})
