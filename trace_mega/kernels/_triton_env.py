"""The one place that decides how Triton runs here: importable or not, interpreted or compiled.

Triton fixes its mode when code is decorated with ``@triton.jit``: with
``TRITON_INTERPRET=1`` in the environment at that moment a kernel becomes an
interpreted (CPU, numpy) function, otherwise a compiled (GPU) one. Part of Triton's
own standard library (``tl.sum``, ``tl.cdiv``, ...) is such code, decorated when
``triton`` is first imported; an interpreted kernel calling a compiled ``tl.sum``
fails ("Cannot call @triton.jit'd outside of the scope of a kernel"). Hence:

* the variable must be set before the process first imports ``triton``, which is
  why this module never imports it at import time;
* a kernel module asks :func:`interpreting` ONCE, at import, where its decorators
  run, and keeps the answer (``_INTERPRET = interpreting()``).

What is here:

* :data:`HAS_TRITON` -- whether the ``triton`` package is installed (CPU installs may lack it).
* :func:`interpreting` -- whether ``@triton.jit`` decorators running now interpret.
* :func:`use_interpreter_without_cuda` -- what the tests and the CPU benchmarks do
  before anything imports Triton: switch the interpreter on when there is no CUDA GPU.
* :func:`env_without_interpreter` -- the environment for a child process that must
  compile for a GPU (an AOT compile check, a training run) whatever its parent uses.
* :func:`aot_compile` -- compile one kernel for an sm_<arch> GPU without a GPU
  (Triton's bundled ptxas): catches register spills and invalid tiles on CPU.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Mapping

HAS_TRITON = importlib.util.find_spec("triton") is not None
"""Whether ``import triton`` can work; found without importing it (see the module docstring)."""

INTERPRET_VAR = "TRITON_INTERPRET"
"""The environment variable Triton reads when ``@triton.jit`` code is decorated."""

__all__ = [
    "HAS_TRITON",
    "INTERPRET_VAR",
    "interpreting",
    "use_interpreter_without_cuda",
    "env_without_interpreter",
    "aot_compile",
]


def interpreting() -> bool:
    """Whether a ``@triton.jit`` decorator running now builds an interpreted kernel.

    Reads Triton's own switch (``triton.knobs.runtime.interpret``: ``TRITON_INTERPRET``
    parsed as Triton parses it), so the answer is exactly what the decorator does.
    False without Triton.
    """
    if not HAS_TRITON:
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def use_interpreter_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` unless a CUDA GPU is visible or the variable is already set.

    Call it before anything imports Triton (a kernel module, or torch code that does).
    Returns :func:`interpreting` afterwards.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault(INTERPRET_VAR, "1")
    return interpreting()


def env_without_interpreter(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's environment) without ``TRITON_INTERPRET``."""
    out = dict(os.environ if env is None else env)
    out.pop(INTERPRET_VAR, None)
    return out


def aot_compile(fn, constexprs: dict, arg_types: dict[str, str], *, arch: int = 90, num_warps: int = 4):
    """Compile the jitted ``fn`` for CUDA sm_<arch> with Triton's bundled ptxas; no GPU needed.

    ``constexprs``: the values of ``fn``'s constexpr arguments; ``arg_types``: the
    Triton type of every other argument (``"*bf16"``, ``"i32"``, ...). Needs the kernel
    module imported without the interpreter (interpreted kernels cannot be compiled).
    Raises on any compile error; returns the compiled kernel.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting() or not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError(f"aot_compile needs the kernel module imported without {INTERPRET_VAR}")
    sig = {name: "constexpr" if name in constexprs else arg_types[name] for name in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
