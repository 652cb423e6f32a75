"""SLURM launch: one torchrun per node, rendezvous on the job's first node.

`scripts/slurm/train.sbatch` runs, on every node of the allocation (one srun task per node),

    python -m trace_mega.commands.launch [--nproc-per-node N] [--port P] [--dry-run] -- train --config X [key=value ...]

which turns the SLURM step's variables into torchrun arguments (`torchrun_args`)
and runs `python -m torch.distributed.run ARGS -m trace_mega train ...` as its
child. torchrun's c10d rendezvous runs on the first node of
SLURM_JOB_NODELIST; every node's agent joins it and starts one worker per GPU.

Preemption (docs/operations.md): the launcher passes SIGTERM, SIGUSR1 and SIGUSR2
on to torchrun, which passes them on to the workers and gives them
`--shutdown-timeout-s` to finish their step and checkpoint before it kills them.
torchrun itself exits 1 whatever its workers' codes were, so a worker that stops
cleanly writes its code to the file named by `TRACE_MEGA_EXIT_FILE`, and the
launcher exits with that code (75: requeue me) instead of torchrun's.

Read from the environment:

* SLURM_JOB_NODELIST (or SLURM_NODELIST) — compressed host list, e.g.
  `gpu[001-004,010],login2`; its first host is the rendezvous host;
* SLURM_JOB_NUM_NODES (or SLURM_NNODES) — the node count (must match the list);
* SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (`8` or `h100:8`) — workers per
  node (`--nproc-per-node` overrides; torchrun's `gpu` when SLURM says nothing);
* SLURM_JOB_ID — the rendezvous id, and the port: 29500 + job id mod 10000
  (jobs sharing a node do not collide), unless `--port` or MASTER_PORT is set.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

from trace_mega.stopping import EXIT_FILE_ENV

_BASE_PORT = 29500
# Passed on to torchrun (and by it to the workers): Slurm's preemption and time-limit warnings.
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _split_top_level(spec: str) -> list[str]:
    """Split at the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {spec!r}")
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in node list {spec!r}")
    items.append(spec[start:])
    return items


def _expand_item(item: str) -> list[str]:
    """`pre[a-b,c]post` -> every host; several bracket groups multiply (`r[1-2]n[1-2]`)."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    values = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)-(\d+)", part)
        if m:
            lo, hi = m.group(1), m.group(2)
            if int(hi) < int(lo):
                raise ValueError(f"descending range {part!r} in node list item {item!r}")
            values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]  # keeps zero padding
        elif re.fullmatch(r"\d+", part):
            values.append(part)
        else:
            raise ValueError(f"bad range {part!r} in node list item {item!r}")
    tails = _expand_item(rest)
    return [prefix + v + t for v in values for t in tails]


def expand_nodelist(spec: str) -> list[str]:
    """Host names of a SLURM node list (`node[01-03,07]` -> node01, node02, node03, node07), in order."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty node list")
    hosts = []
    for item in _split_top_level(spec):
        if not item:
            raise ValueError(f"empty item in node list {spec!r}")
        hosts += _expand_item(item)
    return hosts


def _gpus_per_node(env: Mapping[str, str]) -> Optional[int]:
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    per_node = env.get("SLURM_GPUS_PER_NODE")
    if per_node:  # "8", "h100:8", or "gpu:h100:8"
        m = re.search(r"(\d+)(\(|$)", per_node.split(",")[0])
        if m:
            return int(m.group(1))
    return None


def torchrun_args(
    env: Mapping[str, str], *, nproc_per_node: Optional[str] = None, port: Optional[int] = None
) -> list[str]:
    """torchrun's arguments (before the script) for this node of a SLURM job (see the module docstring)."""
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not spec:
        raise KeyError("SLURM_JOB_NODELIST is not set: run this under srun inside a SLURM allocation")
    hosts = expand_nodelist(spec)
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts))
    if nnodes != len(hosts):
        raise ValueError(f"SLURM says {nnodes} nodes but the node list {spec!r} has {len(hosts)}")
    job = env.get("SLURM_JOB_ID", "0")
    if port is None:
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else _BASE_PORT + int(job) % 10000
    if nproc_per_node is None:
        gpus = _gpus_per_node(env)
        nproc_per_node = str(gpus) if gpus else "gpu"
    return [
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{hosts[0]}:{port}",
        "--rdzv-id",
        f"trace-mega-{job}",
    ]


def main(argv: Optional[Sequence[str]] = None) -> Optional[int]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: python -m trace_mega.commands.launch [--nproc-per-node N] [--port P] [--dry-run] -- "
            "train --config X [key=value ...]",
            file=sys.stderr,
        )
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m trace_mega.commands.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc-per-node", default=None, help="workers per node (default: the node's GPUs from SLURM)")
    ap.add_argument(
        "--port", type=int, default=None, help="rendezvous port (default: MASTER_PORT or 29500 + job id %% 10000)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    ap.add_argument(
        "--shutdown-timeout-s",
        type=int,
        default=600,
        help="after a signal, how long torchrun lets the workers finish their step and checkpoint (default 600)",
    )
    args = ap.parse_args(argv[:cut])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(os.environ, nproc_per_node=args.nproc_per_node, port=args.port),
        "--signals-to-handle",
        ",".join(["SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in _FORWARDED)]),
        "--shutdown-timeout",
        str(args.shutdown_timeout_s),
        "-m",
        "trace_mega",
        *argv[cut + 1 :],
    ]
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    # Megatron's TP communication overlap needs one hardware queue per device; 8 OpenMP
    # threads per worker unless the job sets them (as scripts/launch_multinode.sh does).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "8")
    sys.stdout.flush()
    return run_torchrun(cmd)


def run_torchrun(cmd: list[str]) -> int:
    """Run torchrun (`cmd`), passing the exit signals on; the workers' clean-stop code when one
    wrote it (`EXIT_FILE_ENV`), else torchrun's status (128 + N when a signal N killed it)."""
    with tempfile.TemporaryDirectory(prefix="trace-mega-exit-") as tmp:
        exit_file = Path(tmp) / "code"
        child = subprocess.Popen(cmd, env=dict(os.environ, **{EXIT_FILE_ENV: str(exit_file)}))
        previous = {sig: signal.signal(sig, lambda signum, _frame: child.send_signal(signum)) for sig in _FORWARDED}
        try:
            rc = child.wait()  # retried after each handler (PEP 475)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if exit_file.exists():
            return int(exit_file.read_text())
        return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
