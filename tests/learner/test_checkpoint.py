"""Checkpoints: atomic saves with a manifest, retention, verified resume, and a failing (full) disk.

The fast tests replace megatron's sharded save with a stand-in that writes the same kind of files
(a large shard, its metadata, common.pt); the slow ones save real megatron checkpoints (DP=2)."""

import errno
import json
import logging
import os
import types

import pytest
import torch
from workers.common import save_tiny_hf, torchrun

from trace_mega.learner import checkpoint as ck
from trace_mega.learner.checkpoint import (
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)

SHARD_BYTES = 32 << 20  # above the hashing limit: checked by size only, as a real model's shards
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def save(tmp_path, monkeypatch):
    """`save(step, **kwargs)`: `save_checkpoint` into tmp_path/ck on one rank, megatron stubbed."""

    def fake_dcp_save(state, path, content_metadata=None):
        with open(os.path.join(path, "__0_0.distcp"), "wb") as fh:
            fh.truncate(SHARD_BYTES)  # sparse: fast to write
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            json.dump({"sharded_backend": "torch_dist"}, fh)
        torch.save({"scheduler": state.get("scheduler")}, os.path.join(path, "common.pt"))

    monkeypatch.setattr(ck, "_sharded_state", lambda *a, **k: {})
    monkeypatch.setattr(ck, "dist_checkpointing", types.SimpleNamespace(save=fake_dcp_save))
    monkeypatch.setattr(ck, "_rng_state", lambda: {"torch": torch.get_rng_state()})
    monkeypatch.setattr(ck.dist, "barrier", lambda: None)
    groups = types.SimpleNamespace(rank=0, world_size=1)
    root = tmp_path / "ck"

    def run(step, keep_last=0, keep_every=None, predictor=True):
        extras = {f"predictor_{step:08d}.pt": lambda p: torch.save({"w": torch.full((4,), float(step))}, p)}
        return save_checkpoint(
            root, step, [], None, None, groups, {"cursor": step}, extras if predictor else None, keep_last, keep_every
        )

    run.root = root
    return run


def _names(root):
    return sorted(os.listdir(root))


def _step(root, n):
    return root / checkpoint_name(n)


# ---- A: retention ---------------------------------------------------------------------------
def test_a_save_writes_a_manifest_last_and_moves_latest(save):
    path = save(1)
    root = save.root
    assert path == _step(root, 1) and (root / "latest").read_text() == "step_00000001"
    manifest = json.loads((path / "manifest.json").read_text())
    files, extras = manifest["files"], manifest["extras"]
    assert sorted(files) == ["__0_0.distcp", "common.pt", "metadata.json", "rng/rank_00000.pt", "trainer_state.json"]
    assert files["__0_0.distcp"] == {"bytes": SHARD_BYTES}  # a large shard: its size only
    assert set(files["trainer_state.json"]) == {"bytes", "sha256"} and set(files["metadata.json"]) == {
        "bytes",
        "sha256",
    }
    assert set(extras) == {"predictor_00000001.pt"} and "sha256" in extras["predictor_00000001.pt"]
    assert verify_checkpoint(path) is None and latest_checkpoint(root) == path


def test_keep_last_removes_older_checkpoints_and_their_predictors_but_keeps_milestones(save):
    root = save.root
    for step in range(1, 6):
        save(step, keep_last=2, keep_every=2)
    (root / ".tmp-step_00000009").mkdir()  # left by a killed save
    save(6, keep_last=2, keep_every=2)
    # kept: the 2 newest (5, 6) and the milestones (2, 4); gone: 1, 3, their predictors, the stray tmp dir
    assert _names(root) == [
        "latest",
        *[f"predictor_0000000{s}.pt" for s in (2, 4, 5, 6)],
        *[f"step_0000000{s}" for s in (2, 4, 5, 6)],
    ]


def test_keep_last_zero_keeps_everything_and_the_newest_is_never_removed(save):
    root = save.root
    for step in (1, 2, 3):
        save(step, keep_last=0)
    assert [p for p in _names(root) if p.startswith("step_")] == ["step_00000001", "step_00000002", "step_00000003"]
    assert prune_checkpoints(root, keep_last=1) == [_step(root, 2), _step(root, 1)]
    assert _names(root) == ["latest", "predictor_00000003.pt", "step_00000003"]


def test_retention_leaves_checkpoints_newer_than_latest_alone(save):
    root = save.root
    for step in (1, 2, 3):
        save(step)
    (root / "latest").write_text("step_00000002")  # resumed from 2 (3 was damaged): 3 is not ours to judge
    assert prune_checkpoints(root, keep_last=1) == [_step(root, 1)]
    assert sorted(p for p in _names(root) if p.startswith("step_")) == ["step_00000002", "step_00000003"]


def test_legacy_checkpoints_are_pruned_with_their_predictor_files(save, caplog):
    root = save.root
    old = _step(root, 1)
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text('{"step": 1}')  # written before manifests existed
    (root / "predictor_00000001.pt").write_bytes(b"x")
    save(2, keep_last=1)
    assert _names(root) == ["latest", "predictor_00000002.pt", "step_00000002"]


# ---- B: verified resume ----------------------------------------------------------------------
def _two(save):
    save(1)
    save(2)
    return save.root


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint(save, caplog):
    root = _two(save)
    with open(_step(root, 2) / "__0_0.distcp", "r+b") as fh:
        fh.truncate(1000)
    with caplog.at_level(logging.WARNING, logger="trace_mega.learner.checkpoint"):
        assert latest_checkpoint(root) == _step(root, 1)
    warning = caplog.records[0].getMessage()
    assert warning == (
        f"checkpoint {_step(root, 2)} is damaged or incomplete: step_00000002/__0_0.distcp: 1000 bytes, "
        f"the manifest says {SHARD_BYTES}; trying an older one"
    )
    assert caplog.records[-1].getMessage() == f"resuming from step_00000001, the newest intact checkpoint in {root}"


@pytest.mark.parametrize(
    "damage, problem",
    [
        ('{"step": 3}', "step_00000002/trainer_state.json: contents differ from the manifest (sha256)"),
        ("{", "step_00000002/trainer_state.json: 1 bytes, the manifest says"),
    ],
)
def test_a_corrupt_trainer_state_falls_back(save, caplog, damage, problem):
    root = _two(save)
    state = _step(root, 2) / "trainer_state.json"
    if damage.startswith('{"step"'):  # the same size, other bytes: only the checksum sees it
        damage = state.read_text().replace('"cursor": 2', '"cursor": 7')
    state.write_text(damage)
    with caplog.at_level(logging.WARNING, logger="trace_mega.learner.checkpoint"):
        assert latest_checkpoint(root) == _step(root, 1)
    assert problem in caplog.records[0].getMessage()


def test_a_missing_predictor_or_manifest_entry_is_named(save):
    root = _two(save)
    (root / "predictor_00000002.pt").unlink()
    assert verify_checkpoint(_step(root, 2)) == "predictor_00000002.pt: missing"
    (_step(root, 1) / "rng" / "rank_00000.pt").unlink()
    assert verify_checkpoint(_step(root, 1)) == "step_00000001/rng/rank_00000.pt: missing"
    (_step(root, 1) / "manifest.json").write_text("{not json")
    assert verify_checkpoint(_step(root, 1)).startswith("step_00000001/manifest.json: unreadable (")


def test_a_deleted_latest_resumes_from_the_newest_intact_step(save, caplog):
    root = _two(save)
    (root / "latest").unlink()
    with caplog.at_level(logging.WARNING, logger="trace_mega.learner.checkpoint"):
        assert latest_checkpoint(root) == _step(root, 2)
    assert caplog.records[0].getMessage() == f"{root / 'latest'} is missing; looking for the newest intact checkpoint"


def test_a_stray_tmp_dir_is_ignored(save):
    root = _two(save)
    stray = root / ".tmp-step_00000003"
    stray.mkdir()
    (stray / "trainer_state.json").write_text('{"step": 3}')
    assert latest_checkpoint(root) == _step(root, 2)
    save(3, keep_last=2)  # the next complete save sweeps it away (its own tmp dir is reused)
    assert not list(root.glob(".tmp-*"))


def test_none_intact_fails_with_one_line_naming_the_directory(save):
    root = _two(save)
    for step in (1, 2):
        (_step(root, step) / "trainer_state.json").write_text("{")
    with pytest.raises(CheckpointError) as err:
        latest_checkpoint(root)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no intact checkpoint in {root} (2 damaged; the newest: ")
    assert message.endswith("move them away or set checkpoint.resume: false to start afresh")


def test_empty_or_missing_roots_have_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    (tmp_path / ".tmp-step_00000001").mkdir()  # a first save that never finished
    assert latest_checkpoint(tmp_path) is None


def test_checkpoints_without_a_manifest_still_load(tmp_path, caplog):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / checkpoint_name(3)).mkdir()  # no trainer_state.json: a crashed save
    (tmp_path / checkpoint_name(1)).mkdir()
    (tmp_path / checkpoint_name(1) / "trainer_state.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="trace_mega.learner.checkpoint"):
        assert latest_checkpoint(tmp_path) == tmp_path / checkpoint_name(1)
    messages = [r.getMessage() for r in caplog.records]
    assert any("step_00000003/trainer_state.json: missing (an unfinished save)" in m for m in messages)
    assert messages[-1] == f"{tmp_path / checkpoint_name(1)} has no manifest (written before manifests existed): " + (
        "loading it unverified"
    )


def test_export_finds_checkpoints_through_the_verified_path(save):
    from trace_mega.commands.export import find_checkpoint

    root = _two(save)
    with open(_step(root, 2) / "__0_0.distcp", "r+b") as fh:
        fh.truncate(10)
    assert find_checkpoint(root) == _step(root, 1)
    with pytest.raises(CheckpointError, match=r"step_00000002 is damaged: step_00000002/__0_0\.distcp: 10 bytes"):
        find_checkpoint(root, step=2)


# ---- C: a full disk -----------------------------------------------------------------------------
def _fail(monkeypatch, where):
    if where == "shards":

        def dcp_save(state, path, content_metadata=None):
            open(os.path.join(path, "__0_0.distcp"), "wb").write(b"partial")
            raise ENOSPC

        monkeypatch.setattr(ck, "dist_checkpointing", types.SimpleNamespace(save=dcp_save))
    elif where == "rng":
        real = torch.save

        def torch_save(obj, f, *a, **k):
            if "/rng/rank_" in str(f):
                raise ENOSPC
            return real(obj, f, *a, **k)

        monkeypatch.setattr(ck.torch, "save", torch_save)
    elif where == "manifest":
        monkeypatch.setattr(ck, "_write_manifest", lambda *a: (_ for _ in ()).throw(ENOSPC))
    elif where == "latest":
        monkeypatch.setattr(ck.os, "replace", lambda *a: (_ for _ in ()).throw(ENOSPC))


@pytest.mark.parametrize("where", ["shards", "rng", "manifest", "latest"])
def test_a_failed_write_keeps_the_previous_checkpoint_latest(save, monkeypatch, caplog, where):
    root = save.root
    save(1)
    _fail(monkeypatch, where)
    with caplog.at_level(logging.ERROR, logger="trace_mega.learner.checkpoint"):
        with pytest.raises(CheckpointError) as err:
            save(2, keep_last=1)
    monkeypatch.undo()
    assert str(err.value) == f"checkpoint {_step(root, 2)} not written: OSError: [Errno 28] No space left on device"
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {_step(root, 2)} not written (OSError: [Errno 28] No space left on device); "
        "`latest` still names step_00000001"
    ]
    # the partial temp dir and the new predictor are gone; the previous checkpoint is latest and intact
    assert _names(root) == ["latest", "predictor_00000001.pt", "step_00000001"]
    assert latest_checkpoint(root) == _step(root, 1) and verify_checkpoint(_step(root, 1)) is None


def test_a_disk_without_room_for_another_checkpoint_fails_before_writing(save, monkeypatch):
    root = save.root
    save(1)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=SHARD_BYTES // 2))
    with pytest.raises(
        CheckpointError,
        match=r"not written: OSError: \[Errno 28\] No space left on device: 0\.02 GiB free in .*ck, the last",
    ):
        save(2)
    assert _names(root) == ["latest", "predictor_00000001.pt", "step_00000001"]


# ---- real megatron checkpoints --------------------------------------------------------------------
@pytest.mark.slow
def test_resume_gives_identical_losses(tmp_path):
    hf = save_tiny_hf("dense", tmp_path / "hf", seed=5)
    ckpt = tmp_path / "ckpt"
    base = {"hf": str(hf), "steps": 4, "ckpt": str(ckpt)}
    # Uninterrupted 4 steps (saving at 2 does not disturb them), then a fresh process resuming at 2.
    torchrun("train_worker.py", 2, [json.dumps([{**base, "save_at": 2, "out": str(tmp_path / "full.json")}])])
    assert latest_checkpoint(ckpt) == ckpt / checkpoint_name(2)
    assert verify_checkpoint(ckpt / checkpoint_name(2)) is None
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


@pytest.mark.slow
def test_two_ranks_agree_on_a_failed_save_prune_and_resume_from_the_newest_intact(tmp_path):
    """DP=2, real megatron checkpoints: a write failing on rank 1 alone fails the save on both ranks
    (no hang), retention runs after the next good save, and both ranks resume from the checkpoint
    rank 0 picks when the newest one has a truncated shard."""
    hf = save_tiny_hf("dense", tmp_path / "hf", seed=5)
    root = tmp_path / "ckpt"
    torchrun("checkpoint_worker.py", 2, [str(hf), str(root), str(tmp_path / "out")])
    results = [json.loads((tmp_path / f"out_{rank}.json").read_text()) for rank in (0, 1)]
    for res in results:
        assert res["error"] == (
            f"checkpoint {root / checkpoint_name(3)} not written: rank 1: OSError: [Errno 28] No space left on device"
        )
        assert res["after_failure"] == [
            "latest",
            "predictor_00000001.pt",
            "predictor_00000002.pt",
            "step_00000001",
            "step_00000002",
        ]
        assert res["latest_after_failure"] == "step_00000002"
        assert res["after_prune"] == [
            "latest",
            "predictor_00000002.pt",
            "predictor_00000004.pt",
            "step_00000002",
            "step_00000004",
        ]
        assert res["resumed_cursor"] == 2
