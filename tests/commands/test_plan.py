"""`trace-mega plan`: parameter counts equal the real networks', and the shipped configs fit (or fail naming the field)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from trace_mega.commands.plan import GIB, count_params, format_plan, plan_memory
from trace_mega.config import ConfigError, ModelConfig, TrainConfig, load_yaml
from trace_mega.learner.hf_files import hf_config
from trace_mega.learner.models import model_config_from_hf

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu.yaml"


def _hf_numel(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "model",
    [
        ModelConfig(vocab_size=97, tie_word_embeddings=True),
        ModelConfig(vocab_size=97, tie_word_embeddings=False, num_layers=3, hidden_size=96, head_dim=32),
        ModelConfig(
            vocab_size=101, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, tie_word_embeddings=False
        ),
    ],
)
def test_count_params_equals_the_hf_network(model):
    assert count_params(model).total == _hf_numel(hf_config(model))


def test_count_params_qwen2_bias_and_llama():
    qwen2 = transformers.Qwen2Config(
        vocab_size=90,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    llama = transformers.LlamaConfig(
        vocab_size=90,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    for hf in (qwen2, llama):
        assert count_params(model_config_from_hf(hf)).total == _hf_numel(hf)


def test_shipped_cards_have_the_published_sizes():
    cfg14 = load_yaml(TrainConfig, ROOT / "configs" / "qwen3_14b_multihop.yaml", [])
    cfg30 = load_yaml(TrainConfig, ROOT / "configs" / "qwen3_30b_a3b_bfcl.yaml", [])
    assert plan_memory(cfg14).params_total == pytest.approx(14.77e9, rel=2e-3)  # "14.8B"
    assert plan_memory(cfg30).params_total == pytest.approx(30.53e9, rel=2e-3)  # "30.5B"


@pytest.mark.parametrize("name", ["qwen3_14b_multihop.yaml", "qwen3_30b_a3b_bfcl.yaml"])
def test_shipped_large_configs_fit_their_cluster(name):
    cfg = load_yaml(TrainConfig, ROOT / "configs" / name, [])
    assert cfg.cluster.nodes * cfg.cluster.gpus_per_node == 16 and cfg.cluster.gpu_memory_gib == 80
    plan = plan_memory(cfg)
    assert plan.errors == []
    assert max(plan.peaks(engine_sleeps=True).values()) <= 80 * GIB
    assert plan.kv_tokens >= cfg.rollout.max_total_tokens


def test_sharding_arithmetic_by_hand():
    """A dense model at TP=2, DP=2 (4 GPUs), bf16, distributed optimizer: every component by hand."""
    m = ModelConfig(
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=32,
        vocab_size=1000,
        tie_word_embeddings=False,
        params_dtype="bfloat16",
    )
    cfg = load_yaml(
        TrainConfig,
        DEMO,
        [
            "parallel.tensor_model_parallel_size=2",
            "cluster.nodes=1",
            "cluster.gpus_per_node=4",
            "parallel.micro_batch_tokens=128",
            "rollout.gpu_memory_utilization=0.5",
            "cluster.gpu_memory_gib=10",
        ],
    )
    plan = plan_memory(cfg, model=m)
    h, q, kv = 256, 256, 128
    linear = (h * q + 2 * h * kv + q * h + 3 * h * 512) // 2  # split over TP
    replicated = 2 * h + 2 * 32
    local = 2 * (1000 * h // 2) + 4 * (linear + replicated) + h
    assert plan.params_per_gpu == local
    assert plan.learner_weights == 2 * local and plan.learner_grads == 4 * local
    assert plan.optimizer_state == pytest.approx(12 * local / 2)  # fp32 master + 2 moments over DP=2
    assert plan.layout == dict(tp=2, pp=1, ep=1, dp=2, expert_dp=2, rollout_tp=2, replicas=2)
    assert plan.engine_weights == pytest.approx(count_params(m).total * 2 / 2)
    assert plan.kv_tokens == int(plan.engine_kv // (2 * 4 * (4 // 2) * 32 * 2))


def _plan_errors(name: str, *overrides: str) -> list[str]:
    return plan_memory(load_yaml(TrainConfig, ROOT / "configs" / name, list(overrides))).errors


def test_configs_that_cannot_fit_name_the_field():
    # The 30B config before its fix: EP=8 leaves too much learner state beside the engine.
    errs = _plan_errors("qwen3_30b_a3b_bfcl.yaml", "parallel.expert_model_parallel_size=8")
    assert len(errs) == 1 and errs[0].startswith("rollout.gpu_memory_utilization:")
    # Replicas of 2 GPUs: the engine's weights leave no room for one trajectory's KV cache.
    errs = _plan_errors(
        "qwen3_30b_a3b_bfcl.yaml", "rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.38"
    )
    assert any(e.startswith("rollout.gpu_memory_utilization:") and "KV cache" in e for e in errs)
    # Micro-batches of 16k tokens without recomputation do not fit the 30B learner.
    errs = _plan_errors("qwen3_30b_a3b_bfcl.yaml", "parallel.micro_batch_tokens=16384")
    assert len(errs) == 1 and errs[0].startswith("parallel.micro_batch_tokens:")
    # Layouts that do not divide the model or the world.
    assert any(
        e.startswith("parallel.tensor_model_parallel_size:")
        for e in _plan_errors("qwen3_14b_multihop.yaml", "parallel.tensor_model_parallel_size=16")
    )
    assert any(
        e.startswith("parallel.expert_model_parallel_size:")
        for e in _plan_errors("qwen3_30b_a3b_bfcl.yaml", "parallel.expert_model_parallel_size=12")
    )


def test_engine_sleep_changes_the_training_peak():
    cfg = load_yaml(TrainConfig, ROOT / "configs" / "qwen3_14b_multihop.yaml", [])
    plan = plan_memory(cfg)
    asleep, awake = plan.peaks(engine_sleeps=True), plan.peaks(engine_sleeps=False)
    assert awake["train"] - asleep["train"] == pytest.approx(plan.engine_reserved)
    assert asleep["rollout"] == awake["rollout"]
    table = format_plan(cfg, plan)
    assert "peak while training, engine asleep" in table and table.rstrip().endswith("fits")


def test_unknown_checkpoint_without_config_is_a_config_error(tmp_path):
    cfg = load_yaml(TrainConfig, DEMO, [f"model.hf_checkpoint={tmp_path / 'NoSuchModel-7B'}"])
    with pytest.raises(ConfigError, match="model.hf_checkpoint: .*NoSuchModel-7B"):
        plan_memory(cfg)


def test_checkpoint_config_json_wins_over_cards(tmp_path):
    hf = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    ckpt = tmp_path / "Qwen3-14B"  # named like a card, but its own config.json is read
    hf.save_pretrained(ckpt)
    cfg = load_yaml(TrainConfig, DEMO, [f"model.hf_checkpoint={ckpt}"])
    assert plan_memory(cfg).params_total == _hf_numel(hf)


@pytest.mark.slow
def test_cli_exit_codes():
    cmd = [
        sys.executable,
        "-m",
        "trace_mega",
        "plan",
        "--config",
        str(ROOT / "configs" / "qwen3_30b_a3b_bfcl.yaml"),
    ]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "| engine KV cache |" in ok.stdout and ok.stdout.rstrip().endswith("fits")
    bad = subprocess.run(cmd + ["--gpu-memory-gib", "40"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does NOT fit" in bad.stdout and "40.0 GiB" in bad.stdout
