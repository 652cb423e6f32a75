"""Throughput metrics: the model-FLOPs count behind perf/mfu and the per-trajectory response lengths."""

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from trace_mega.config import ModelConfig
from trace_mega.learner.hf_files import hf_config
from trace_mega.rollout.tree import Node, RolloutTree, pack
from trace_mega.telemetry import forward_flops, response_lengths, throughput_metrics


def test_forward_flops_by_hand_and_against_torch_flop_counter():
    m = ModelConfig(vocab_size=40)  # 2 layers, hidden 64, 4 heads x 16, 2 KV groups, FFN 128
    # per token and layer: QKV 64 x (64 + 2 x 32) + output 64 x 64 = 12288 multiply-adds,
    # gated MLP 3 x 64 x 128 = 24576; LM head 64 x 40 = 2560; attention 2 x 64 per key and layer.
    per_token = 2 * (2 * (12288 + 24576) + 2560)
    assert forward_flops(m, 12, 0) == 12 * per_token
    assert forward_flops(m, 12, 78) == 12 * per_token + 2 * 2 * 2 * 64 * 78
    # The matmul FLOPs torch counts in the HF model's forward (its attention is not counted there).
    net = transformers.AutoModelForCausalLM.from_config(hf_config(m)).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(torch.arange(12)[None] % 40)
    assert counter.get_total_flops() == forward_flops(m, 12, 0)
    moe = ModelConfig(vocab_size=40, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    assert forward_flops(moe, 1, 0) == 2 * (2 * (12288 + 2 * 3 * 64 * 32 + 64 * 8) + 2560)


def test_response_lengths_and_throughput_keys():
    tree = RolloutTree("p", [1, 2, 3])
    a = tree.add_node(0, Node(-1, [4, 5, 6], [1, 1, 0], [0.0] * 3))
    tree.add_node(a, Node(-1, [7], [1], [0.0], reward=1.0))
    tree.add_node(a, Node(-1, [8, 9], [1, 1], [0.0] * 2, reward=0.0))
    tree.add_node(0, Node(-1, [10], [1], [0.0], reward=0.0))
    packed = pack([tree])
    assert sorted(response_lengths(packed).tolist()) == [1.0, 3.0, 4.0]
    out = throughput_metrics(
        packed, 2.0, ModelConfig(vocab_size=40), world_size=4, replicas=2, epochs=1, device=torch.device("cpu")
    )
    assert out["perf/generated_tokens_per_s"] == 6 / 2.0 and out["perf/generated_tokens_per_s_per_gpu"] == 6 / 8.0
    assert out["perf/trained_tokens_per_s"] == packed.tokens.numel() / 2.0
    assert out["rollout/response_length_max"] == 4.0 and "perf/mfu" not in out  # no peak on CPU
    # CPU: the process's peak resident set, at least what a 64 MiB tensor held now adds.
    held = torch.ones(1 << 24)
    rss = throughput_metrics(
        packed, 2.0, ModelConfig(vocab_size=40), world_size=4, replicas=2, epochs=1, device=torch.device("cpu")
    )["perf/peak_memory_gib"]
    assert rss >= held.numel() * 4 / 2**30 and rss >= out["perf/peak_memory_gib"] > 0
