"""The device mesh pp x dp x cp x tp (innermost last, docs/design.md §3) and the groups cut from it."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm.links import connect_neighbours
from ..config import ParallelConfig

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass
class ParallelDims:
    config: ParallelConfig
    mesh: DeviceMesh
    group_options: tuple | None = None      # (backend, options) of every group cut from the mesh
    _dp_cp: DeviceMesh | None = field(default=None, repr=False)

    def group(self, dim: str):
        return self.mesh.get_group(dim)

    def rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """dp x cp flattened: parameters are replicated over cp, so gradients reduce over both."""
        if self._dp_cp is None:
            kwargs = ({"backend_override": self.group_options}
                      if self.group_options and _accepts(DeviceMesh._flatten, "backend_override") else {})
            self._dp_cp = self.mesh["dp", "cp"]._flatten("dp_cp", **kwargs)
        return self._dp_cp


def _accepts(function, name: str) -> bool:
    return name in inspect.signature(function).parameters


def group_options(device_type: str, timeout: timedelta | None) -> tuple | None:
    """(backend, options) giving a group `timeout`: groups cut from a mesh do not inherit the default
    group's (they waited torch's 30 minutes for a dead peer). None where torch offers no options."""
    if timeout is None:
        return None
    if device_type == "cuda":
        backend, options_class = "nccl", getattr(dist, "ProcessGroupNCCL", None)
        options_class = getattr(options_class, "Options", None)
    else:
        backend, options_class = "gloo", getattr(getattr(dist, "ProcessGroupGloo", None), "_Options", None)
    if options_class is None:
        return None
    options = options_class()
    options._timeout = timeout
    return backend, options


def build_mesh(config: ParallelConfig, device_type: str, timeout: timedelta | None = None) -> ParallelDims:
    """Validate the layout against the world and build the mesh (needs an initialised process group);
    its groups wait `timeout` for a peer (torch's default when None)."""
    config.validate(world_size=dist.get_world_size())
    shape = tuple(getattr(config, dim) for dim in MESH_DIMS)
    options = group_options(device_type, timeout)
    if not _accepts(init_device_mesh, "backend_override"):
        options = None
    kwargs: dict[str, Any] = {"backend_override": {dim: options for dim in MESH_DIMS}} if options else {}
    dims = ParallelDims(config, init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS, **kwargs),
                        options)
    if config.cp > 1:
        _link_cp_neighbours(dims, device_type, timeout)
    return dims


def _link_cp_neighbours(dims: ParallelDims, device_type: str, timeout: timedelta | None) -> None:
    """The CP hand-overs' point-to-point links, made now rather than in the first step (comm/links.py)."""
    cp_axis = MESH_DIMS.index("cp")
    ranks = dims.mesh.mesh.movedim(cp_axis, -1).reshape(-1, dims.config.cp).tolist()
    mine = dims.group("cp")
    me = dist.get_rank()
    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device(device_type))
    backend = "nccl" if device_type == "cuda" else "gloo"
    connect_neighbours(ranks, [mine if me in row else None for row in ranks], device, timeout, backend)
