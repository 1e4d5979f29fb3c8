"""Argument checks shared by the ops: each failure is a ValueError that names the argument."""
from __future__ import annotations

import os
from typing import overload

import torch
from gdn_kernels.host_index import derived


def values_checked(x: torch.Tensor) -> bool:
    """Whether to run checks that read tensor values on the host.

    On GPUs such a read is a device sync, which stalls the host and, under context parallelism,
    the wavefront of ranks; there the checks run only with GDN_PARALLEL_CHECK_VALUES=1.
    """
    return x.device.type == "cpu" or os.environ.get("GDN_PARALLEL_CHECK_VALUES") == "1"


@overload
def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, total: int, name: str = ...) -> torch.Tensor: ...
@overload
def check_cu_seqlens(cu_seqlens: None, batch: int, total: int, name: str = ...) -> None: ...
@overload
def check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, total: int,
                     name: str = ...) -> torch.Tensor | None: ...
def check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, total: int,
                     name: str = "cu_seqlens") -> torch.Tensor | None:
    """Validate document boundaries of a packed row: int, 1-D, starts at 0, increasing, ends at T.

    Returns the boundaries as an int64 tensor (or None when not given).
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D integer tensor [num_seqs + 1], got "
                         f"{getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"{name} must hold integers, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(f"{name} is given with batch size {batch}; packed documents need batch size 1: "
                         f"flatten the batch into one row [1, total] and describe it with {name}")
    # The values are read once per tensor (a device sync where they live on a GPU): every layer of a
    # row checks the same boundaries, dozens of times a step.
    as_int64 = derived(cu_seqlens, ("checked boundaries", total),
                       lambda: _checked_boundaries(cu_seqlens, total, name))
    return cu_seqlens if as_int64 is None else as_int64


def _checked_boundaries(cu_seqlens: torch.Tensor, total: int, name: str) -> torch.Tensor | None:
    """The value checks of check_cu_seqlens; returns the int64 copy, or None where it is int64 already
    (kept by `derived`, the tensor itself would never be released)."""
    values = cu_seqlens.detach().to("cpu", torch.int64)
    bounds = values.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be strictly increasing (no empty documents), got {bounds}")
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at the sequence length {total}, got {bounds[-1]}")
    return None if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, dims=None) -> None:
    """Shapes (selected dims) and dtype of `b` must match `a`."""
    if a.dtype != b.dtype:
        raise ValueError(f"{name_b} has dtype {b.dtype} but {name_a} has {a.dtype}; cast them to one dtype")
    dims = range(a.dim()) if dims is None else dims
    if b.dim() != a.dim() or any(a.shape[d] != b.shape[d] for d in dims):
        raise ValueError(f"{name_b} has shape {tuple(b.shape)}, incompatible with {name_a} {tuple(a.shape)}")
