"""Every group cut from the mesh waits train.collective_timeout_s for a peer, not torch's 30 minutes:
groups made from a mesh do not inherit the default group's timeout (measured: 1800 s before)."""
from datetime import timedelta

import torch

from gdn_parallel.config import ParallelConfig
from gdn_parallel.parallel.mesh import MESH_DIMS, build_mesh
from tests.parallel.launcher import run_workers


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout   # private, as torch keeps it


def mesh_timeouts(rank, world):
    dims = build_mesh(ParallelConfig(dp=2, cp=2), "cpu", timedelta(seconds=7))
    return {**{dim: _timeout(dims.group(dim)) for dim in MESH_DIMS},
            "dp_cp": _timeout(dims.dp_cp_mesh.get_group())}


def test_the_mesh_groups_take_the_run_timeout():
    for timeouts in run_workers(mesh_timeouts, 4):
        assert timeouts == {name: timedelta(seconds=7) for name in (*MESH_DIMS, "dp_cp")}, timeouts
