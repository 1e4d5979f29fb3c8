"""The model and optimizer state of a rank in a layout-free form, for torch.distributed.checkpoint.

Every tensor is saved under its name in the single-device model (`model.<name>`, and
`optim.<name>.<state>` for AdamW's moments and step), with the global shape it has there:

- FSDP2 shards over dp are gathered to the tensor-parallel piece (one parameter at a time);
- tensor-parallel pieces (parameters marked `_tp_shard_dim`) become DTensors sharded over the tp
  mesh, so the checkpoint records their global shape and each piece's offset;
- pipeline stages save only their own parameters (names are the full model's);
- replicas (dp, cp, and tp for replicated parameters) hold the same values; DCP writes them once.

Loading builds the same form for the current layout and lets DCP read each rank's pieces: a
checkpoint saved under one layout loads under any other.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..parallel.tensor import tp_shard_dim

MODEL, OPTIM = "model.", "optim."


def _tp_mesh(dims):
    return dims.mesh["tp"] if dims is not None and dims.config.tp > 1 else None


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """The rank's whole tensor-parallel piece of an FSDP2-sharded tensor (a collective over its mesh)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layout_free(piece: torch.Tensor, param: nn.Parameter, tp_mesh) -> torch.Tensor:
    dim = tp_shard_dim(param)
    if dim is None or tp_mesh is None:
        return piece
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(piece, tp_mesh, [Shard(dim)], run_check=False)


def _slots(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in sorted(optimizer.state.get(param, {}).items()):
        if isinstance(value, torch.Tensor):
            yield name, value


def state_to_save(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                  dims) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint: every parameter and optimizer slot in layout-free form."""
    if optimizer is not None:
        _check_optimizer_covers(named_params, optimizer)
    tp_mesh = _tp_mesh(dims)
    state: dict[str, torch.Tensor] = {}
    for name, param in named_params:
        state[MODEL + name] = _layout_free(_gathered(param.detach()), param, tp_mesh)
        if optimizer is not None:
            for slot, value in _slots(optimizer, param):
                scalar = value.dim() == 0
                value = value if scalar else _layout_free(_gathered(value), param, tp_mesh)
                state[f"{OPTIM}{name}.{slot}"] = value
    return state


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
    """Buffers of the layout-free form for this rank, for DCP to fill (their values are overwritten)."""
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
    return state_to_save(named_params, optimizer, dims)  # copies: gathered pieces, or fresh DTensor views


@torch.no_grad()
def apply_loaded(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                 loaded: dict[str, torch.Tensor]) -> None:
    """Copy what DCP read into the parameters and optimizer slots of this rank (its own shards)."""
    for name, param in named_params:
        _copy_into(param, loaded[MODEL + name])
        if optimizer is not None:
            for slot, value in _slots(optimizer, param):
                _copy_into(value, loaded[f"{OPTIM}{name}.{slot}"])


def _copy_into(destination: torch.Tensor, source: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor
    if isinstance(source, DTensor):
        source = source.to_local()
    if isinstance(destination, DTensor):  # FSDP2: keep this rank's shard of the piece
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
