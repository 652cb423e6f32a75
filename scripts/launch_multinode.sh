#!/usr/bin/env bash
# Multi-node launch: run this same command on every node.
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node0 host> bash scripts/launch_multinode.sh configs/qwen3_14b_multihop.yaml [key=value ...]
# torchrun starts one process per GPU; trace_mega reads RANK/WORLD_SIZE/LOCAL_RANK
# from its environment and builds the TP/PP/EP/DP groups from the config.
set -euo pipefail
CONFIG=${1:?usage: launch_multinode.sh CONFIG [overrides...]}
shift
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${GPUS_PER_NODE:=$(nvidia-smi -L 2>/dev/null | wc -l)}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m trace_mega train --config "$CONFIG" "$@"
