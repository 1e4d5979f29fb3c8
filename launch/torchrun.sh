#!/usr/bin/env bash
# Launch training on one or more nodes with torchrun. Every argument goes to gdn_parallel.train:
#   launch/torchrun.sh --config configs/h1-1.3b.yaml --set parallel.cp=2 --set parallel.dp=4
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) on every node, e.g. from
# slurm: NNODES=$SLURM_NNODES NODE_RANK=$SLURM_NODEID MASTER_ADDR=$(scontrol show hostnames | head -1)
set -euo pipefail
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec torchrun --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$NPROC_PER_NODE" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}" \
    -m gdn_parallel.train "$@"
