"""The device mesh pp x dp x cp x tp (innermost last, docs/design.md §3) and the groups cut from it."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ParallelConfig

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass
class ParallelDims:
    config: ParallelConfig
    mesh: DeviceMesh

    def group(self, dim: str):
        return self.mesh.get_group(dim)

    def rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """dp x cp flattened: parameters are replicated over cp, so gradients reduce over both."""
        return self.mesh["dp", "cp"]._flatten("dp_cp")


def build_mesh(config: ParallelConfig, device_type: str) -> ParallelDims:
    """Validate the layout against the world and build the mesh (needs an initialised process group)."""
    config.validate(world_size=dist.get_world_size())
    shape = (config.pp, config.dp, config.cp, config.tp)
    return ParallelDims(config, init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS))
