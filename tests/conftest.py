"""Test-wide setup: Triton's interpreter on CPU, the `gpu` marker, quiet threads.

The interpreter must be switched on before any `@triton.jit` decorator runs, i.e.
before the kernel modules are imported, so it is done here at collection time.
"""

import os

import pytest
import torch

from trace_mega.kernels._triton_env import use_interpreter_without_cuda

use_interpreter_without_cuda()
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# CI replays the same examples every run (a property failure there is reproducible, never
# a coin flip); local runs keep exploring new ones. (The vLLM stage's venv has no hypothesis.)
try:
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
