"""The CPU compatibility layer: pinned version, and every patch still needed (fails on an upgrade that changes that)."""

import json
import os
import subprocess
import sys

import megatron.core
import pytest
import torch
from workers.common import ROOT, WORKERS, free_port

from trace_mega.learner import cpu_compat


def test_pinned_version_is_installed():
    assert megatron.core.__version__ == cpu_compat.PINNED_MEGATRON_CORE == "0.16.1"


def test_other_versions_are_refused(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="pinned to megatron-core==0.16.1"):
        cpu_compat.check_version(strict=True)
    with pytest.warns(UserWarning, match="re-measure"):
        cpu_compat.check_version(strict=False)


def test_not_applied_for_cuda_device():
    assert cpu_compat.enable_cpu_compat("cuda") is False


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the patched problems are those of a CPU-only torch")
def test_every_patched_problem_exists_unpatched():
    """Unpatched megatron-core (fresh process) still raises each documented error; no patch is spare."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKERS)]),
        PROBE_PORT=str(free_port()),
        PYTHONWARNINGS="ignore",
    )
    res = subprocess.run(
        [sys.executable, str(WORKERS / "probe_unpatched.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(l for l in res.stdout.splitlines() if l.startswith("PROBE "))
    probes = json.loads(line[len("PROBE ") :])
    assert sorted(probes) == sorted(p.name for p in cpu_compat.PATCHES), "a patch without a probe (or vice versa)"
    gone = {name: r["detail"] for name, r in probes.items() if not r["present"]}
    assert not gone, f"no longer needed or changed upstream, re-measure these patches: {gone}"
