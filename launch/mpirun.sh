#!/usr/bin/env bash
# Launch training with Open MPI's mpirun, one process per GPU. Every argument goes to gdn_parallel.train:
#   launch/mpirun.sh --config configs/h1-1.3b.yaml --set parallel.cp=2 --set parallel.dp=4
# Multi-node: HOSTFILE=my_hosts NP=16 launch/mpirun.sh ... (format: launch/hostfile.example). The trainer
# takes its rank from OMPI_COMM_WORLD_*; MASTER_ADDR, when not exported here, is rank 0's host found
# through mpi4py (pip install mpi4py), else export MASTER_ADDR=<first host of the hostfile>.
# MPICH / Intel MPI instead: mpiexec -n 16 -ppn 8 -hosts node01,node02 python3 -m gdn_parallel.train ...
set -euo pipefail
NP=${NP:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
ARGS=(-np "$NP" --bind-to none)   # no core pinning: each process runs many threads (data, NCCL, OpenMP)
if [[ -n "${HOSTFILE:-}" ]]; then ARGS+=(--hostfile "$HOSTFILE"); fi
# Open MPI passes remote processes only the variables named with -x.
for name in PATH LD_LIBRARY_PATH PYTHONPATH MASTER_ADDR MASTER_PORT OMP_NUM_THREADS; do
    if [[ -n "${!name:-}" ]]; then ARGS+=(-x "$name"); fi
done
exec mpirun "${ARGS[@]}" python3 -m gdn_parallel.train "$@"
