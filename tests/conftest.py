"""Test-wide setup: Triton's interpreter on CPU, the `gpu` marker, quiet threads.

TRITON_INTERPRET must be set before any `@triton.jit` decorator runs, i.e.
before the kernel modules are imported, so it is set here at collection time.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
