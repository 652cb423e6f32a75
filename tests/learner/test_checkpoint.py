"""dist_checkpointing resume: DP=2 with the distributed optimizer, interrupted at step 2, resumes exactly."""

import json

import pytest
from workers.common import save_tiny_hf, torchrun

from trace_mega.learner.checkpoint import checkpoint_name, latest_checkpoint

pytestmark = pytest.mark.slow


def test_resume_gives_identical_losses(tmp_path):
    hf = save_tiny_hf("dense", tmp_path / "hf", seed=5)
    ckpt = tmp_path / "ckpt"
    base = {"hf": str(hf), "steps": 4, "ckpt": str(ckpt)}
    # Uninterrupted 4 steps (saving at 2 does not disturb them), then a fresh process resuming at 2.
    torchrun("train_worker.py", 2, [json.dumps([{**base, "save_at": 2, "out": str(tmp_path / "full.json")}])])
    assert latest_checkpoint(ckpt) == ckpt / checkpoint_name(2)
    assert not list(ckpt.glob(".tmp-*")), "the temporary checkpoint dir must have been renamed"
    state = json.loads((ckpt / checkpoint_name(2) / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["cursor"] == 2
    torchrun("train_worker.py", 2, [json.dumps([{**base, "resume": True, "out": str(tmp_path / "resumed.json")}])])
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert full["dp_size"] == 2
    assert [s["step"] for s in resumed["steps"]] == [2, 3]
    for got, want in zip(resumed["steps"], full["steps"][2:]):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
        assert got["lr"] == want["lr"]


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / checkpoint_name(3)).mkdir()  # no trainer_state.json: a crashed save
    (tmp_path / checkpoint_name(1)).mkdir()
    (tmp_path / checkpoint_name(1) / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / checkpoint_name(1)
