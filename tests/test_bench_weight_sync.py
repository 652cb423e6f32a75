"""benchmarks/bench_weight_sync.py: the measured path runs and counts bytes; the projection's arithmetic."""

import argparse

import pytest

from trace_mega.commands.cli import load_benchmark

bench = load_benchmark("weight_sync")

ASSUME = argparse.Namespace(
    nvlink_gbps=360.0, ib_gbps=45.0, hbm_gbps=1500.0, bucket_mib=512.0, latency_us=30.0, engine_us_per_tensor=50.0
)


@pytest.mark.slow
def test_measured_sync_counts_bytes_per_rank():
    rows = bench._measure(2, reps=1, model=[])  # the demo's tiny policy at learner TP = 2
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["bytes_to_engine"] == 4 * r["params"]  # fp32 full tensors, every parameter once
        assert 0 < r["bytes_received"] < r["bytes_to_engine"]  # the peers' TP shards
        assert r["export_s"] > 0 and r["load_s"] > 0


def test_projection_bytes_follow_the_layouts():
    p14 = bench.project("qwen3_14b_multihop.yaml", ASSUME)
    p30 = bench.project("qwen3_30b_a3b_bfcl.yaml", ASSUME)
    # 14B at TP 8: a rank gathers 7/8 of the weights; aligned replicas (rollout TP 8) need nothing from peers.
    assert p14["gather_bytes_received_gb"] == pytest.approx(p14["weights_gb"] * 7 / 8, rel=1e-3)
    assert p14["aligned_bytes_received_gb"] == 0.0
    # 30B at TP 2 x EP 16 into TP-4 replicas: an engine rank needs 32 of 128 experts and holds 8.
    assert p30["layout"]["rollout_tp"] == 4 and p30["layout"]["ep"] == 16
    assert 0 < p30["aligned_bytes_received_gb"] < p30["gather_bytes_received_gb"]
    assert p30["hf_tensors"] == 48 * (9 + 3 * 128) + 3
    assert p30["aligned_s"] < p30["gather_s"] and p14["aligned_s"] < p14["gather_s"]
