#!/usr/bin/env bash
# Launch training with the DeepSpeed launcher, one process per GPU. Every argument goes to gdn_parallel.train:
#   launch/deepspeed.sh --config configs/h1-1.3b.yaml --set parallel.cp=2 --set parallel.dp=4
# Multi-node: HOSTFILE=my_hosts launch/deepspeed.sh ... (format: launch/hostfile.example; run it on the first
# host, which holds rank 0; the launcher reaches the others by passwordless ssh through pdsh).
# The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process; the
# trainer shares each node's CPU cores among its processes (gdn_parallel/runtime/launch_env.py).
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [[ -n "${HOSTFILE:-}" ]]; then
    HOSTS=(--hostfile="$HOSTFILE")   # slots per host = processes per host
else
    HOSTS=(--num_gpus="${NUM_GPUS:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}")
fi
# --no_local_rank: the trainer reads LOCAL_RANK from the environment, not a --local_rank argument.
COMMAND=(deepspeed "${HOSTS[@]}" --master_port="${MASTER_PORT:-29500}" --no_local_rank
         --module gdn_parallel.train "$@")
if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${COMMAND[@]}"; echo; exit 0; fi
exec "${COMMAND[@]}"
