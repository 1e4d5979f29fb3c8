"""Every group cut from the mesh waits train.collective_timeout_s for a peer, not torch's 30 minutes:
groups made from a mesh do not inherit the default group's timeout (measured: 1800 s before). The CP
neighbours' point-to-point links are made with the mesh (comm/links.py)."""
from datetime import timedelta

import torch

from gdn_parallel.config import ParallelConfig
from gdn_parallel.parallel.mesh import MESH_DIMS, build_mesh
from tests.parallel.launcher import SharedLaunch, run_workers


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout   # private, as torch keeps it


def mesh_timeouts(rank, world):
    dims = build_mesh(ParallelConfig(dp=2, cp=2), "cpu", timedelta(seconds=7))
    return {**{dim: _timeout(dims.group(dim)) for dim in MESH_DIMS},
            "dp_cp": _timeout(dims.dp_cp_mesh.get_group())}


def test_the_mesh_groups_take_the_run_timeout():
    for timeouts in MESH_TIMEOUTS("timeouts"):
        assert timeouts == {name: timedelta(seconds=7) for name in (*MESH_DIMS, "dp_cp")}, timeouts


def cp_links(rank, world):
    """cp=4 (and dp=1): each rank linked to its CP neighbours only, the links taking the run's timeout;
    a hand-over in both directions goes through them as batched ops and arrives intact."""
    from gdn_parallel.comm import links

    dims = build_mesh(ParallelConfig(cp=4), "cpu", timedelta(seconds=7))
    cp_rank = dims.rank("cp")
    linked = {peer: links.link(peer) is not None for peer in range(world) if peer != rank}
    batched = []
    original = torch.distributed.batch_isend_irecv
    torch.distributed.batch_isend_irecv = lambda ops: batched.append(len(ops)) or original(ops)
    try:
        if cp_rank + 1 < world:
            links.isend(torch.full((3,), float(rank)), rank + 1, dims.group("cp")).wait()
        if cp_rank > 0:
            got = torch.empty(3)
            links.irecv(got, rank - 1, dims.group("cp")).wait()
            assert torch.equal(got, torch.full((3,), float(rank - 1)))
    finally:
        torch.distributed.batch_isend_irecv = original
    timeouts = {peer: _timeout(links.link(peer)) for peer, yes in linked.items() if yes}
    return linked, batched, timeouts


def test_cp_neighbours_are_linked_before_the_first_step():
    # a launch of its own: the links a process holds are all the meshes it built (a shared launch's
    # other cases link other pairs)
    for rank, (linked, batched, timeouts) in enumerate(run_workers(cp_links, 4)):
        assert linked == {peer: abs(peer - rank) == 1 for peer in range(4) if peer != rank}, (rank, linked)
        assert batched == [1] * ((rank < 3) + (rank > 0)), batched
        assert set(timeouts.values()) == {timedelta(seconds=7)}, timeouts


# Shares a launch of 4 processes with other modules' cases (tests/parallel/launcher.py, SharedLaunch).
MESH_TIMEOUTS = SharedLaunch({"timeouts": (4, mesh_timeouts)})
