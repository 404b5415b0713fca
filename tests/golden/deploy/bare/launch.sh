#!/usr/bin/env bash
# dstrain launch for bare metal: run this once on every node (job "debug").
#   NNODES=2 MASTER_ADDR=<first node> bash launch.sh     # on each of the 2 nodes
# Every variable below can be set in the environment; the values here come from the config.
# Restarts: torchrun restarts the whole worker group up to MAX_RESTARTS times when a worker
# dies; the workers resume from the newest checkpoint. A lost node ends the job.
# Every node must see the same run directory (run.root: runs) and DIR: each rank
# writes its own checkpoint shards there.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${NNODES:=2}"
: "${NPROC_PER_NODE:=8}"
: "${MASTER_ADDR:=127.0.0.1}"
: "${MASTER_PORT:=29400}"
: "${RDZV_ID:=debug}"
: "${MAX_RESTARTS:=3}"
: "${DSTRAIN_CONFIG:=$HERE/config.toml}"
export NNODES NPROC_PER_NODE MASTER_ADDR MASTER_PORT RDZV_ID MAX_RESTARTS DSTRAIN_CONFIG
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"
export NCCL_IB_HCA="${NCCL_IB_HCA:-mlx5}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec "${PYTHON:-python3}" -m torch.distributed.run \
  --nnodes="$NNODES" \
  --nproc-per-node="$NPROC_PER_NODE" \
  ${NODE_RANK:+--node-rank="$NODE_RANK"} \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-id="$RDZV_ID" \
  --max-restarts="$MAX_RESTARTS" \
  -m dstrain.train "$DSTRAIN_CONFIG"
