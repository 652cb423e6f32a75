"""kernels/_triton_env.py: the one decision "interpreted or compiled", and the AOT-compile helper."""

import subprocess
import sys

import pytest
import torch

import trace_mega.kernels.boundary_scoring as bsm
from trace_mega.kernels._triton_env import INTERPRET_VAR, aot_compile, env_without_interpreter, interpreting


def test_env_without_interpreter_drops_only_the_switch():
    env = env_without_interpreter({INTERPRET_VAR: "1", "OMP_NUM_THREADS": "1"})
    assert env == {"OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is switched on only without CUDA")
def test_kernel_modules_keep_the_decision_made_at_import():
    assert interpreting() and bsm._INTERPRET  # tests/conftest.py switched it on before any import
    # A fresh process: the helper switches it on, every kernel module sees it, and
    # clearing the variable afterwards does not change what the modules were built as.
    code = (
        "import os; from trace_mega.kernels._triton_env import use_interpreter_without_cuda, interpreting; "
        "assert use_interpreter_without_cuda(); "
        "import trace_mega.kernels.token_logprobs as a, trace_mega.kernels.boundary_scoring as b, "
        "trace_mega.kernels.tree_attention as c; del os.environ['TRITON_INTERPRET']; "
        "print(a._INTERPRET, b._INTERPRET, c._INTERPRET, interpreting())"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env_without_interpreter(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "True", "True", "False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs interpreted kernels")
def test_aot_compile_refuses_interpreted_kernels():
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        aot_compile(bsm._fwd_kernel, {"BLOCK_P": 32, "BLOCK_H": 128}, {})
