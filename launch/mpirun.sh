#!/usr/bin/env bash
# Launch training with Open MPI's mpirun, one process per GPU. Every argument goes to gdn_parallel.train:
#   launch/mpirun.sh --config configs/h1-1.3b.yaml --set parallel.cp=2 --set parallel.dp=4
# Multi-node: HOSTFILE=my_hosts launch/mpirun.sh ... (format: launch/hostfile.example): NP defaults to the
# hostfile's slots, without one to this node's GPUs. The trainer takes its rank from OMPI_COMM_WORLD_*;
# MASTER_ADDR, when not exported here, is rank 0's host found through mpi4py (pip install mpi4py), else
# export MASTER_ADDR=<first host of the hostfile>.
# MPICH / Intel MPI instead: mpiexec -n 16 -ppn 8 -hosts node01,node02 python3 -m gdn_parallel.train ...
# Open MPI passes remote processes only the variables named with -x: this script names those below, every
# exported variable with a prefix of FORWARD_PREFIXES, and the names in FORWARD (FORWARD="A B").
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
FORWARD_NAMES=(PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV MASTER_ADDR MASTER_PORT)
# NCCL, W&B, torch, Triton, Hugging Face, CUDA, OpenMP and fabric settings (not CUDA_VISIBLE_DEVICES,
# which each node's own allocation sets)
FORWARD_PREFIXES=(NCCL_ WANDB_ TORCH_ TORCHINDUCTOR_ PYTORCH_ TRITON_ HF_ CUDA_ OMP_ FI_ UCX_)

hostfile_slots() {  # the sum of the hostfile's slots=N; a host line without one is an error
    local line total=0
    if [[ ! -r "$1" ]]; then
        echo "launch/mpirun.sh: HOSTFILE=$1 cannot be read; give the path of a hostfile" \
             "(format: launch/hostfile.example)" >&2
        return 1
    fi
    while read -r line; do
        line=${line%%#*}
        [[ -z "${line// /}" ]] && continue
        if [[ "$line" =~ (^|[[:space:]])slots=([0-9]+) ]]; then
            total=$((total + BASH_REMATCH[2]))
        else
            echo "launch/mpirun.sh: HOSTFILE=$1: the line '$line' has no slots=N; give each host its" \
                 "processes (GPUs) as in launch/hostfile.example, or set NP" >&2
            return 1
        fi
    done < "$1"
    echo "$total"
}

if [[ -n "${NP:-}" ]]; then
    :
elif [[ -n "${HOSTFILE:-}" ]]; then
    NP=$(hostfile_slots "$HOSTFILE")
else
    NP=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
ARGS=(-np "$NP" --bind-to none)   # no core pinning: the trainer shares the node's cores among its processes
if [[ -n "${HOSTFILE:-}" ]]; then ARGS+=(--hostfile "$HOSTFILE"); fi
for name in "${FORWARD_NAMES[@]}" ${FORWARD:-}; do
    if [[ -n "${!name:-}" ]]; then ARGS+=(-x "$name"); fi
done
for name in $(compgen -e | LC_ALL=C sort); do
    for prefix in "${FORWARD_PREFIXES[@]}"; do
        if [[ "$name" == "$prefix"* && "$name" != CUDA_VISIBLE_DEVICES && " ${ARGS[*]} " != *" $name "* ]]; then
            ARGS+=(-x "$name")
        fi
    done
done
COMMAND=(mpirun "${ARGS[@]}" python3 -m gdn_parallel.train "$@")
if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${COMMAND[@]}"; echo; exit 0; fi
exec "${COMMAND[@]}"
