"""The CPU compatibility layer for megatron-core (the ONE place that patches another library).

megatron-core assumes CUDA throughout: no GPTModel configuration runs on a
CPU-only torch build unpatched (measured; docs/learner.md, "The CPU compatibility
layer", states the facts and lists every patch with the error it avoids).
`enable_cpu_compat()` applies the small set of patches below, once per
process, and only when the configured device is CPU. Each patch names the
error it avoids. The layer is pinned to megatron-core `PINNED_MEGATRON_CORE`;
`tests/learner/test_cpu_compat.py` checks, against unpatched megatron-core,
that every patched problem still exists and every patch target still has the
expected shape, so an upgrade that changes what needs patching fails CI.

Things that are NOT patches (they are configuration or our own `ModuleSpec`
leaves, see `models.py`): the local layer spec, `use_cpu_initialization`,
an RMSNorm leaf tagged for sequence parallelism, `add_bias_linear=False` for MoE.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

PINNED_MEGATRON_CORE = "0.16.1"
"""The only megatron-core version these patches were measured against."""

__all__ = ["PINNED_MEGATRON_CORE", "PATCHES", "Patch", "enable_cpu_compat", "is_enabled", "check_version"]


@dataclass(frozen=True)
class Patch:
    """One documented patch: what it changes and which error it avoids."""

    name: str
    target: str
    """Dotted path(s) of what is replaced."""
    avoids: str
    """The error raised by unpatched megatron-core on CPU."""
    apply: Callable[[], None]


# --------------------------------------------------------------------------- RNG
def _get_rng_state_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in of `tensor_parallel.random._get_cuda_rng_state` (same signature)."""
    return torch.get_rng_state()


def _set_rng_state_cpu(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """CPU stand-in of `tensor_parallel.random._set_cuda_rng_state` (same signature)."""
    torch.set_rng_state(new_state)


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker with the named states kept as CPU generator states.

        On CPU the "device" generator is the CPU generator, so `fork` swaps the
        CPU state in and out itself (the parent's fork warns when the CPU state
        changes inside the context, which here is the point).
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _get_rng_state_cpu
    mrandom._set_cuda_rng_state = _set_rng_state_cpu
    mrandom.CudaRNGStatesTracker = _cpu_tracker_class()


# --------------------------------------------------------------- device arguments
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # A bare int is a CUDA ordinal (`torch.cuda.current_device()` returns one).
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Runs megatron's hard-coded CUDA tensor creation on CPU.

    * `device="cuda"` / `device=<int>` keyword or positional device of `.to()` -> cpu
    * `Tensor.cuda()` -> the tensor itself
    * `Tensor.type()` (no argument) of a CPU float tensor -> the CUDA type name,
      because the optimizers dispatch on `param.type() == 'torch.cuda.FloatTensor'`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[t.dtype]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if (
            func is torch.Tensor.to
            and len(args) > 1
            and (isinstance(args[1], (str, torch.device)) or type(args[1]) is int)
            and _is_cuda_device(args[1])
        ):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_MODE: _CudaToCpuMode | None = None


def _patch_device_mode() -> None:
    global _MODE
    _MODE = _CudaToCpuMode()
    # Megatron's distributed optimizer zeroes the grads of its parameter-shard views (non-leaf
    # tensors; `_zero_grad_group_helper` reads `.grad`), which makes torch warn on every step under
    # DP > 1. With this mode on the stack the warning points at this file, so the console would take
    # it for the project's own; on GPU it points at Megatron and stays in the log file.
    warnings.filterwarnings(
        "ignore", message=r"The \.grad attribute of a Tensor that is not a leaf", category=UserWarning, module=__name__
    )
    # Entered for the life of the process: megatron creates CUDA tensors at
    # import-independent times (buffers, masks, optimizer state, schedules).
    _MODE.__enter__()


def _patch_current_device() -> None:
    # A CPU device, not an ordinal: `device=torch.cuda.current_device()` is also
    # used inside autograd backward functions (tensor_parallel/layers.py), where
    # torch does not propagate the TorchFunctionMode below.
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu


# ------------------------------------------------------------------ CUDA streams
class _NullStream:
    """A do-nothing CUDA stream / event: CPU ops are synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullStream":
        return _NullStream()

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NULL_STREAM = _NullStream()


def _patch_streams() -> None:
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


# -------------------------------------------------------------- MoE alltoall
def _patch_alltoall_splits() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        """Like megatron's, but also turns CPU split-size tensors into host numbers.

        Upstream only converts CUDA tensors, so on CPU the split sizes stay
        tensors and `all_to_all_single` rejects them.
        """
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    # 0.16.1 imports te_general_gemm inside a try block that fails without TE,
    # leaving the name undefined; the router then reads it.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


PATCHES: tuple[Patch, ...] = (
    Patch(
        "rng_tracker",
        "megatron.core.tensor_parallel.random._get_cuda_rng_state, _set_cuda_rng_state, CudaRNGStatesTracker",
        "AssertionError: Torch not compiled with CUDA enabled (tensor_parallel/random.py); "
        "unpatched _set_cuda_rng_state also silently never runs (torch.cuda._lazy_call)",
        _patch_rng,
    ),
    Patch(
        "current_device",
        "torch.cuda.current_device",
        "AssertionError: Torch not compiled with CUDA enabled (GlobalMemoryBuffer, router, embeddings)",
        _patch_current_device,
    ),
    Patch(
        "cuda_device_mode",
        "a TorchFunctionMode over every torch call (device='cuda', Tensor.cuda, Tensor.type)",
        "AssertionError: Torch not compiled with CUDA enabled (~60 hard-coded device='cuda'); "
        "AssertionError in clip_grads / TypeError 'Wrapped parameters must be one of "
        "torch.cuda.FloatTensor' in the optimizers",
        _patch_device_mode,
    ),
    Patch(
        "cuda_streams",
        "torch.cuda.Stream, Event, current_stream, stream",
        "RuntimeError: torch.cuda.Stream requires CUDA support (MoE alltoall dispatcher)",
        _patch_streams,
    ),
    Patch(
        "cuda_synchronize",
        "torch.cuda.synchronize",
        "AssertionError: Torch not compiled with CUDA enabled (pipeline p2p shape exchange "
        "with variable_seq_lengths, p2p_communication._communicate_shapes)",
        _patch_synchronize,
    ),
    Patch(
        "alltoall_split_sizes",
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        "TypeError: all_to_all_single(): incompatible function arguments",
        _patch_alltoall_splits,
    ),
    Patch(
        "te_general_gemm",
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        "NameError: name 'te_general_gemm' is not defined (MoE router without Transformer Engine)",
        _patch_te_general_gemm,
    ),
)

_ENABLED = False


def check_version(strict: bool = True) -> str:
    """Return megatron-core's version; raise (strict) or warn when it is not the pinned one."""
    import megatron.core

    version = megatron.core.__version__
    if version != PINNED_MEGATRON_CORE:
        msg = (
            f"trace_mega's CPU compatibility layer is pinned to megatron-core=={PINNED_MEGATRON_CORE}, "
            f"found {version}; re-measure what needs patching (tests/learner/test_cpu_compat.py)"
        )
        if strict:
            raise RuntimeError(msg)
        warnings.warn(msg)
    return version


def is_enabled() -> bool:
    """Whether `enable_cpu_compat` has patched this process."""
    return _ENABLED


def enable_cpu_compat(device: str | torch.device = "cpu") -> bool:
    """Apply every patch in `PATCHES` once, iff `device` is CPU. Returns whether the layer is active.

    Refuses (RuntimeError) on a megatron-core other than the pinned version,
    and in a process that already uses CUDA, where the patches would break it.
    """
    global _ENABLED
    if torch.device(device).type != "cpu":
        return False
    if _ENABLED:
        return True
    check_version(strict=True)
    if torch.cuda.is_initialized():
        raise RuntimeError("enable_cpu_compat: this process already uses CUDA; the CPU patches would break it")
    for patch in PATCHES:
        patch.apply()
    _ENABLED = True
    return True
