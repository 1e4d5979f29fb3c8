"""The model and optimizer state of a rank in a layout-free form, for torch.distributed.checkpoint.

Every tensor is saved under its name in the single-device model (`model.<name>`, and
`optim.<name>.<state>` for AdamW's moments and step), with the global shape it has there, as a
DTensor over the rank's (tp, dp, cp) mesh whose placements say where its piece lies, in the order
the piece was cut:

- tp: tensor-parallel pieces (parameters marked `_tp_shard_dim`) are Shard(that dim);
- dp: FSDP2's shards of the tp piece are Shard(0), as FSDP2 cut them (torch.chunk's rule, DTensor's);
- replicas (dp under DDP, cp always): each replica writes its own share of dim 0, so that no rank
  copies more than its share to the host. Gathering whole tensors on every rank instead held the
  whole model and its AdamW moments a rank (16 GiB at h1-1.3b) on the GPU and then on the host.
A replica split that would leave some rank no rows is not made (DCP writes that tensor once); a
tensor FSDP2 left some rank no rows of is gathered to its tp piece. Pipeline stages save only their
own parameters (names are the full model's).

Loading asks for the rank's whole piece (replicas Replicate) and lets DCP read it from whatever
pieces were saved: a checkpoint saved under one layout loads under any other.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.tensor import local_tensor, tp_shard_dim

MODEL, OPTIM = "model.", "optim."


def _slots(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in sorted(optimizer.state.get(param, {}).items()):
        if isinstance(value, torch.Tensor):
            yield name, value


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of piece `index` of `length` cut in `parts` by torch.chunk's rule (DTensor's)."""
    size = -(-length // parts)
    offset = min(size * index, length)
    return offset, max(0, min(length, offset + size) - offset)


def _cuts_whole(length: int, parts: int) -> bool:
    """Whether torch.chunk's rule gives every one of `parts` pieces at least one row."""
    return parts == 1 or -(-length // parts) * (parts - 1) < length


@dataclass(frozen=True)
class _Placement:
    """Where this rank's piece of one tensor lies: per mesh dim (tp, dp, cp) the tensor dim it is
    sharded on (None: replicated); `fsdp` whether dp's shard is FSDP2's own (else a save split)."""
    tp: int | None
    dp: int | None
    cp: int | None
    fsdp: bool


MESH_ORDER = ("tp", "dp", "cp")   # the order the pieces are cut in: tp, then FSDP2 (dp), then the save


class _Layout:
    """The rank's (tp, dp, cp) mesh and degrees; `mesh` None for one process."""

    def __init__(self, dims):
        self.mesh, self.dims = None, dims
        if dims is None or dims.mesh.size() == 1:
            return
        self.mesh = _cut_order_mesh(dims)
        self.degrees = {name: self.mesh.size(i) for i, name in enumerate(MESH_ORDER)}
        self.coords = dict(zip(MESH_ORDER, self.mesh.get_coordinate()))

    def placement(self, value: torch.Tensor, param: nn.Parameter) -> _Placement | None:
        """How `value` (the parameter or a slot of it) is saved as it lies; None: gathered."""
        from torch.distributed.tensor import DTensor
        shape = _global_shape(value, param, self.degrees["tp"])
        tp = tp_shard_dim(param) if self.degrees["tp"] > 1 else None
        rows = shape[0] // self.degrees["tp"] if tp == 0 else shape[0]   # dim 0 of the tp piece
        fsdp = isinstance(value, DTensor) and self.degrees["dp"] > 1
        if fsdp and not _cuts_whole(rows, self.degrees["dp"]):
            return None   # FSDP2 left a rank an empty shard: DCP gets the gathered tp piece
        dp = 0 if fsdp or _cuts_whole(rows, self.degrees["dp"]) else None
        dp_pieces = range(self.degrees["dp"]) if dp == 0 else ()
        pieces = [_chunk(rows, self.degrees["dp"], i)[1] for i in dp_pieces] or [rows]
        cp = 0 if all(_cuts_whole(n, self.degrees["cp"]) for n in pieces) else None
        return _Placement(tp, dp, cp, fsdp)

    def save_form(self, value: torch.Tensor, param: nn.Parameter, where: _Placement) -> torch.Tensor:
        """The rank's share of `value` as a DTensor: its piece, cut further along the replica splits
        (views, no copy)."""
        piece = local_tensor(value)
        for name in ("dp", "cp"):
            if getattr(where, name) is None or (name == "dp" and where.fsdp):
                continue
            offset, length = _chunk(piece.shape[0], self.degrees[name], self.coords[name])
            piece = piece.narrow(0, offset, length)
        return self._dtensor(piece, value, param, where)

    def load_form(self, value: torch.Tensor, param: nn.Parameter, where: _Placement) -> torch.Tensor:
        """A buffer for the rank's whole piece of `value` (replicas read it all)."""
        whole = _Placement(where.tp, 0 if where.fsdp else None, None, where.fsdp)
        return self._dtensor(local_tensor(value).clone(), value, param, whole)

    def _dtensor(self, piece, value, param, where: _Placement):
        from torch.distributed.tensor import DTensor, Replicate, Shard
        shape = _global_shape(value, param, self.degrees["tp"])
        placements = [Replicate() if getattr(where, name) is None else Shard(getattr(where, name))
                      for name in MESH_ORDER]
        return DTensor.from_local(piece, self.mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))


def _cut_order_mesh(dims):
    """The rank's (tp, dp, cp) mesh, from the existing groups (no new communicator): DTensor cuts
    along its mesh dims in order, and the pieces are cut tp first (the layer splits), then by FSDP2
    over dp, then by the save over the replicas; mesh slicing keeps the parent's order (pp, dp, cp, tp)."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = dims.mesh
    names = list(mesh.mesh_dim_names)
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if name in MESH_ORDER else coord[i] for i, name in enumerate(names))
    kept = [name for name in names if name in MESH_ORDER]
    ranks = mesh.mesh[index].permute(*[kept.index(name) for name in MESH_ORDER]).contiguous()
    return DeviceMesh.from_group([mesh.get_group(name) for name in MESH_ORDER], mesh.device_type, mesh=ranks,
                                 mesh_dim_names=MESH_ORDER)


def _global_shape(value: torch.Tensor, param: nn.Parameter, tp: int) -> tuple[int, ...]:
    """The shape in the single-device model: FSDP2's DTensor knows its tp piece's shape; tp pieces
    are equal (the layer splits check it), so the whole is tp of them."""
    shape = list(value.shape)
    dim = tp_shard_dim(param) if tp > 1 else None
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def _gathered(value: torch.Tensor) -> torch.Tensor:
    """The rank's whole tensor-parallel piece of an FSDP2-sharded tensor (a collective over its mesh)."""
    from torch.distributed.tensor import DTensor
    return value.full_tensor() if isinstance(value, DTensor) else value


def _tp_form(piece: torch.Tensor, param: nn.Parameter, layout: _Layout) -> torch.Tensor:
    """A gathered tp piece as a DTensor over tp (replicated over dp and cp: DCP writes it once)."""
    dim = tp_shard_dim(param)
    if layout.mesh is None or dim is None or layout.degrees["tp"] == 1:
        return piece
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(piece, layout.dims.mesh["tp"], [Shard(dim)], run_check=False)


def rank_tensors(named_params, optimizer) -> Iterator[tuple[str, torch.Tensor, nn.Parameter]]:
    """(checkpoint key, tensor, its parameter) for every parameter and optimizer slot of the rank."""
    for name, param in named_params:
        yield MODEL + name, param.detach(), param
        if optimizer is not None:
            for slot, value in _slots(optimizer, param):
                yield f"{OPTIM}{name}.{slot}", value, param


def _forms(named_params, optimizer, dims, load: bool) -> dict[str, torch.Tensor]:
    layout = _Layout(dims)
    state: dict[str, torch.Tensor] = {}
    for key, value, param in rank_tensors(named_params, optimizer):
        if value.dim() == 0:                       # AdamW's step: the same on every rank
            state[key] = value
            continue
        where = None if layout.mesh is None else layout.placement(value, param)
        if where is not None:
            state[key] = (layout.load_form if load else layout.save_form)(value, param, where)
        else:
            state[key] = _tp_form(_gathered(value), param, layout)
    return state


def state_to_save(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                  dims) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint: every parameter and optimizer slot in layout-free form,
    views of the rank's tensors (no copy) except where a tensor is gathered (module docstring)."""
    if optimizer is not None:
        _check_optimizer_covers(named_params, optimizer)
    return _forms(named_params, optimizer, dims, load=False)


def _check_optimizer_covers(named_params: list[tuple[str, nn.Parameter]],
                            optimizer: torch.optim.Optimizer) -> None:
    """Once the optimizer has stepped, every parameter saved must be one it holds state for: a
    parameter object it does not know (FSDP2's unsharded form left exposed, say) would leave its
    slots out of the checkpoint, which could then never be resumed. Fail the save instead."""
    if not optimizer.state:
        return  # before the first step: no slots anywhere
    unknown = [name for name, param in named_params if not optimizer.state.get(param)]
    if unknown:
        raise RuntimeError(f"no optimizer state for {len(unknown)} parameter(s) being saved "
                           f"({', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''}): the module "
                           f"exposes other tensors than the optimizer's parameters (an FSDP2 module left "
                           f"unsharded?); the checkpoint would not resume, so it is not written")


def targets_to_load(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                    dims) -> dict[str, torch.Tensor]:
    """Buffers of the layout-free form for this rank's whole pieces, for DCP to fill: copies (the
    rank's tensors change only in apply_loaded), or views of them for one process."""
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
    return _forms(named_params, optimizer, dims, load=True)


@torch.no_grad()
def apply_loaded(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                 loaded: dict[str, torch.Tensor]) -> None:
    """Copy what DCP read into the parameters and optimizer slots of this rank (its own pieces)."""
    for key, value, _param in rank_tensors(named_params, optimizer):
        _copy_into(value, loaded[key])


def _copy_into(destination: torch.Tensor, source: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor
    if isinstance(source, DTensor):
        source = source.to_local()
    if isinstance(destination, DTensor):
        if destination.to_local().shape != source.shape:   # a gathered tp piece: keep this rank's shard
            source = distribute_tensor(source.to(destination.device), destination.device_mesh,
                                       destination.placements, src_data_rank=None).to_local()
        destination = destination.to_local()
    destination.copy_(source.to(destination.device, destination.dtype))


@torch.no_grad()
def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's slots for parameters that have none yet (before its first step), the way
    the optimizer itself creates them: one step with zero gradients and a learning rate of zero, which
    changes no parameter. Their values are then overwritten by the checkpoint's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return
    saved = [(group["lr"], group.get("weight_decay")) for group in optimizer.param_groups]
    grads = {p: p.grad for p in params}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, (lr, _) in zip(optimizer.param_groups, saved):
            group["lr"] = lr
        for p in params:
            p.grad = grads[p]
