"""MoE rollout routing replay (R3): the learner's log-probs are those of the engine's experts.

A tiny Qwen3-MoE (8 experts, top-2). The torch engine runs it with perturbed routers, so it routes
some tokens to other experts than the learner would; it captures its routes on the rollout trees.
With replay, the learner's log-probs equal an HF forward of every path with the routers forced to
the engine's experts; without replay they do not (a replay that silently does nothing fails
here). The metrics count the replayed routes and the share the learner's router agrees with.
Each run is a torchrun/gloo job (megatron's global state stays out of the test process).
"""

import json
import subprocess
import sys

import pytest
import torch
from workers.common import ROOT, read_json, torchrun

from trace_mega.kernels._triton_env import env_without_interpreter


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_moe_e8")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _run(
    hf_dir, tmp_path, tp: int, ep: int, pp: int, noise: float, micro_batch_tokens: int = 4096, recompute: bool = False
) -> dict:
    out = tmp_path / f"tp{tp}_ep{ep}_pp{pp}_n{noise}_r{int(recompute)}.json"
    # EP shards the experts over data-parallel ranks: tp * pp * ep processes give DP = EP.
    args = [str(hf_dir), str(out), str(tp), str(ep), str(pp), str(noise), str(micro_batch_tokens), str(int(recompute))]
    torchrun("routing_replay_worker.py", tp * ep * pp, args, timeout=400)
    return read_json(out) | {"weights": torch.load(f"{out}.rank0.pt")}


def _check_replay(res: dict) -> None:
    assert res["loss_tokens"] > 20 and res["unrouted_tokens"] > 0  # the leaves' last tokens: never fed
    # With replay the learner computes exactly the forced-routing forward ...
    assert res["replay_vs_forced"] < 1e-4
    # ... without it, the perturbed routes change the log-probs: replay is not a no-op.
    assert res["own_vs_forced"] > 1e-2
    assert res["reference_routes_on_its_own"]
    # The predictor's scoring forwards replay the engine's routes too (and that is not a no-op).
    assert res["score_vs_replayed"] < 1e-4 and res["score_own_gap"] > 1e-3
    m = res["metrics"]
    assert m["moe/replayed_tokens"] == res["routed_tokens"]
    assert 0.3 < m["moe/replay_agreement"] < 0.99
    assert m["moe/replay_agreement"] == pytest.approx(res["expected_agreement"], abs=0.01)
    # The replay probe: the same tokens routed on their own, beside the replayed mismatch.
    assert m["mismatch/k3"] == pytest.approx(res["k3_replayed"], rel=1e-3)
    assert m["moe/own_routing_k3"] == pytest.approx(res["k3_own"], rel=1e-3)
    assert m["moe/own_routing_k3"] > 3 * m["mismatch/k3"]


def test_replay_reproduces_the_engines_routing(hf_dir, tmp_path):
    _check_replay(_run(hf_dir, tmp_path, 1, 1, 1, noise=1.0))


@pytest.mark.parametrize("pp,micro", [(1, 4096), pytest.param(2, 24, marks=pytest.mark.slow)])
def test_replay_holds_in_the_backward_recompute(hf_dir, tmp_path, pp, micro):
    """Under activation recompute megatron runs every layer's forward again in backward, outside
    the forward's replay: the recompute must take the engine's routes too, or the update is the
    gradient of other experts than the loss's (0.3-0.6 of the routes differ at this noise). PP = 2
    with 24-token micro-batches: many micro-batches under 1F1B, whose recomputes pair with their
    forwards in order."""
    plain = _run(hf_dir, tmp_path, 1, 1, pp, noise=1.0, micro_batch_tokens=micro)
    recomputed = _run(hf_dir, tmp_path, 1, 1, pp, noise=1.0, micro_batch_tokens=micro, recompute=True)
    assert plain["weights"].keys() == recomputed["weights"].keys()
    for name, w in plain["weights"].items():
        assert torch.allclose(recomputed["weights"][name], w, rtol=0, atol=1e-6), name
    _check_replay(recomputed)  # the metrics count the recompute's routes once per loss forward
    assert recomputed["metrics"]["moe/replayed_tokens"] == plain["metrics"]["moe/replayed_tokens"]


def test_unperturbed_engine_routes_agree_with_the_learners(hf_dir, tmp_path):
    res = _run(hf_dir, tmp_path, 1, 1, 1, noise=0.0)
    assert res["replay_vs_forced"] < 1e-4 and res["own_vs_forced"] < 1e-4
    assert res["metrics"]["moe/replay_agreement"] > 0.99
    m = res["metrics"]  # the same routes: the probe's own-routing mismatch is the replayed one
    assert m["moe/own_routing_k3"] == pytest.approx(m["mismatch/k3"], rel=1e-3, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,pp,micro", [(2, 1, 1, 4096), (1, 2, 1, 4096), (1, 1, 2, 24)])
def test_replay_under_tensor_sequence_expert_and_pipeline_parallelism(hf_dir, tmp_path, tp, ep, pp, micro):
    """TP=2 (sequence parallel: each rank replays its block of the sequence), EP=2 (DP=2: each rank
    its trees in training), PP=2 (each stage its own layer) with one tree per micro-batch (24
    tokens: the 1F1B schedule interleaves the micro-batches' forwards and backwards)."""
    _check_replay(_run(hf_dir, tmp_path, tp, ep, pp, noise=1.0, micro_batch_tokens=micro))


@pytest.mark.slow
@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_trainer_replays_the_torch_engines_routes(tmp_path, params_dtype):
    """A `trace-mega train` run of an MoE policy: the torch engine captures, the agent loop stores the
    routes on the trees, the learner replays them every step (same weights: its router agrees). In
    bfloat16 (the GPU configs' dtype: megatron's bf16 weights, float32 main weights) the engine
    computes in the learner's dtype too, and the update stays finite."""
    overrides = [
        f"model.params_dtype={params_dtype}",
        "allocation.prompts_per_step=8",
        "allocation.root_rollouts_per_step=12",
        "rollout.max_turns=4",
        "telemetry.tensorboard=false",
        "telemetry.progress_bars=false",
        "steps=2",
        "model.num_experts=8",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=32",
        f"telemetry.out_dir={tmp_path}",
    ]
    cmd = [sys.executable, "-m", "trace_mega", "train", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), *overrides]
    env = env_without_interpreter() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["moe/replayed_tokens"] > 100
        assert row["moe/replay_agreement"] > 0.99
        assert row["mismatch/logprob_abs_max"] < 0.2 and row["loss/skipped"] == 0.0
        assert all(v == v for k, v in row.items() if k.startswith("loss/"))  # no NaN


def test_plan_counts_the_replay_buffers():
    """`trace-mega plan`: tokens / TP (sequence parallel) x local layers x top-k int64 per GPU, in the
    training peak; nothing for `moe_routing_replay: none` or a dense model."""
    from trace_mega.commands.plan import format_plan, plan_memory
    from trace_mega.config import TrainConfig, load_yaml

    moe = [
        "model.num_experts=8",
        "model.moe_router_topk=2",
        "model.num_layers=4",
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.micro_batch_tokens=1024",
        "cluster.gpus_per_node=4",
    ]
    demo = ROOT / "configs" / "demo_cpu.yaml"
    on = plan_memory(load_yaml(TrainConfig, demo, moe))
    off = plan_memory(load_yaml(TrainConfig, demo, [*moe, "model.moe_routing_replay=none"]))
    assert on.routing_replay == 1024 / 2 * (4 // 2) * 2 * 8
    assert off.routing_replay == 0.0
    assert on.peaks(engine_sleeps=True)["train"] - off.peaks(engine_sleeps=True)["train"] == on.routing_replay
    assert plan_memory(load_yaml(TrainConfig, demo, [])).routing_replay == 0.0
    assert "MoE routing replay" in format_plan(load_yaml(TrainConfig, demo, moe), on)
    # The step's routes in each process's host memory: 32 roots + 32 continuations on one replica
    # (TP 2 x PP 2: one engine over the 4 GPUs), 256 tokens each, 4 layers x 2 slots of int16.
    assert on.host_routes == 64 * 256 * 4 * 2 * 2 and off.host_routes == 0.0
    assert "MoE routes" in format_plan(load_yaml(TrainConfig, demo, moe), on)
    # vLLM's capture buffer (int32, 16384 batched tokens x 4 layers x 2) comes out of the KV cache.
    vllm = plan_memory(load_yaml(TrainConfig, demo, [*moe, "rollout.engine=vllm"]))
    assert on.engine_routing == 0.0 and vllm.engine_routing == 16384 * 4 * 2 * 4
    assert on.engine_kv - vllm.engine_kv == vllm.engine_routing
    # Recompute keeps each local layer's (split) input for both in-flight micro-batches plus one layer,
    # and the replay targets of both micro-batches until their backward.
    rec = plan_memory(load_yaml(TrainConfig, demo, [*moe, "parallel.recompute_activations=true"]))
    assert rec.activations < on.activations
    assert rec.activations == 1024 * 4 * 64 / 2 * 2 * 2 + on.activations / (2 * 2)
    assert rec.routing_replay == 2 * on.routing_replay
