"""Run in a fresh process WITHOUT the CPU compatibility layer: does each patched problem still exist?

Prints one JSON object {patch name: {"present": bool, "detail": str}}. A patch
whose problem is gone after a megatron-core upgrade shows present=false, and
tests/learner/test_cpu_compat.py fails so the patch gets removed, not carried.
"""

import inspect
import json
import os

import torch
import torch.distributed as dist


def raises(fn, exc_types, needle: str) -> tuple[bool, str]:
    try:
        fn()
    except exc_types as exc:  # the known error, with its message
        return needle in str(exc), f"{type(exc).__name__}: {exc}"[:200]
    return False, "no error"


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{os.environ['PROBE_PORT']}")
    cuda_msg = "Torch not compiled with CUDA enabled"
    out = {}

    ok, detail = raises(lambda: mrandom._get_cuda_rng_state(), AssertionError, cuda_msg)
    sig_ok = (
        list(inspect.signature(mrandom._get_cuda_rng_state).parameters) == ["device", "clone", "graph_safe"]
        and list(inspect.signature(mrandom._set_cuda_rng_state).parameters) == ["new_state", "device", "graph_safe"]
        and hasattr(mrandom.CudaRNGStatesTracker, "fork")
    )
    out["rng_tracker"] = {"present": ok and sig_ok, "detail": detail}

    parallel_state._set_global_memory_buffer()
    ok, detail = raises(
        lambda: parallel_state.get_global_memory_buffer().get_tensor((2,), torch.float32, "probe"),
        AssertionError,
        cuda_msg,
    )
    out["current_device"] = {"present": ok, "detail": detail}

    # Hard-coded device='cuda' (clip_grads) and the CUDA type-name check on grads.
    ok1, d1 = raises(lambda: clip_grads.get_grad_norm_fp32([torch.ones(3)]), AssertionError, cuda_msg)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    ok2, d2 = raises(lambda: clip_grads.clip_grad_by_total_norm_fp32([p], 1.0, 2.0), AssertionError, "")
    out["cuda_device_mode"] = {"present": ok1 and ok2, "detail": f"{d1} | {d2}"}

    ok1, d1 = raises(lambda: torch.cuda.Stream(), RuntimeError, "requires CUDA support")
    uses = "torch.cuda.Stream()" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher)
    out["cuda_streams"] = {"present": ok1 and uses, "detail": d1}

    ok1, d1 = raises(lambda: torch.cuda.synchronize(), AssertionError, cuda_msg)
    from megatron.core.pipeline_parallel import p2p_communication

    uses = "torch.cuda.synchronize()" in inspect.getsource(p2p_communication.P2PCommunicator._communicate_shapes)
    out["cuda_synchronize"] = {"present": ok1 and uses, "detail": d1}

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1]), as_numpy=True)
    ok, detail = raises(
        lambda: dist.all_to_all_single(
            torch.empty(1), torch.ones(1), output_split_sizes=splits, input_split_sizes=splits
        ),
        TypeError,
        "incompatible function arguments",
    )
    out["alltoall_split_sizes"] = {"present": torch.is_tensor(splits) and ok, "detail": detail}

    ok, detail = raises(
        lambda: moe_utils.router_gating_linear(torch.ones(2, 4), torch.ones(3, 4), None, torch.float32),
        NameError,
        "te_general_gemm",
    )
    out["te_general_gemm"] = {"present": ok, "detail": detail}
    print("PROBE " + json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
