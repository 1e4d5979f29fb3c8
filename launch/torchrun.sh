#!/usr/bin/env bash
# Launch training on one or more nodes with torchrun. Arguments go to gdn_parallel.train; those before a
# `--` go to torchrun itself (without a `--`, every argument goes to the trainer):
#   launch/torchrun.sh --config configs/h1-1.3b.yaml --set parallel.cp=2 --set parallel.dp=4
#   launch/torchrun.sh --max-restarts=3 -- --config configs/h1-1.3b.yaml --set train.out_dir=runs/a --resume auto
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) on every node, e.g. from
# slurm: NNODES=$SLURM_NNODES NODE_RANK=$SLURM_NODEID MASTER_ADDR=$(scontrol show hostnames | head -1)
# The rendezvous stays torchrun's static one (--master_addr/--master_port), which keeps restarts of
# several nodes in step (README, "Several nodes"). DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
TORCHRUN_OPTIONS=()
for ((i = 1; i <= $#; i++)); do
    if [[ "${!i}" == "--" ]]; then
        TORCHRUN_OPTIONS=("${@:1:i-1}")
        shift "$i"
        break
    fi
done
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
COMMAND=(torchrun --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$NPROC_PER_NODE"
         --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}"
         ${TORCHRUN_OPTIONS[@]+"${TORCHRUN_OPTIONS[@]}"} -m gdn_parallel.train "$@")
if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${COMMAND[@]}"; echo; exit 0; fi
exec "${COMMAND[@]}"
