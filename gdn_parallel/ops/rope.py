"""Rotary position embedding and the per-token document bookkeeping of packed rows.

Packed rows ([1, total] with `cu_seqlens`) hold several documents back to back; positions restart
at 0 in every document so a document sees the same rotary phases wherever it was packed.
"""
from __future__ import annotations

import functools

import torch
from gdn_kernels.host_index import document_ids, on_device

from .triton_dispatch import auto_uses_triton, imported_kernel
from .validation import check_cu_seqlens

__all__ = ["positions_from_cu_seqlens", "document_ids_from_cu_seqlens", "apply_rotary"]


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int, device=None) -> torch.Tensor:
    """Index of the document each of the `total` tokens belongs to (int64, on `device`, by default
    cu_seqlens' own). Host boundaries with a GPU `device`: checked on the host, copied once per tensor
    (no device sync)."""
    return document_ids(_checked_on(cu_seqlens, total, device), total)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int, device=None) -> torch.Tensor:
    """Position of each token inside its own document: 0 at every document start (int64, on `device`
    as in document_ids_from_cu_seqlens)."""
    cu = _checked_on(cu_seqlens, total, device)
    return torch.arange(total, device=cu.device) - cu[document_ids(cu, total)]


def _checked_on(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """The boundaries checked where they are (read on the host), then placed on `device`: checking
    after the copy would read them back from the device."""
    cu = check_cu_seqlens(cu_seqlens, 1, total)
    return cu if device is None else on_device(cu, device)


ROPE_IMPLS = ("auto", "torch")


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, theta: float = 10000.0,
                 impl: str = "auto") -> torch.Tensor:
    """Rotate x [B, T, H, D] by its positions, Llama/HF "rotate_half" layout.

    Channel pairs are (i, i + D/2) with frequency theta^(-2i/D); the angles are computed in fp32
    (bf16 positions/angles lose whole radians at long context) and the result is cast back to x.dtype.
    `position_ids` is [B, T] or [T] (shared by the batch). impl "auto": on CUDA the fused Triton kernel
    serves (gdn_kernels.rope: x read and written once, the same angles), elsewhere the formula below;
    "torch": the formula on any device (the kernel's oracle).
    """
    if impl not in ROPE_IMPLS:
        raise ValueError(f"impl must be one of {ROPE_IMPLS}, got {impl!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-D tensor [B, T, H, D], got {getattr(x, 'shape', type(x).__name__)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    B, T, _, D = x.shape
    if D % 2 != 0:
        raise ValueError(f"x has head dim {D}; rotary embedding needs an even head dim")
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() \
            or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise ValueError("position_ids must be an integer tensor [B, T] or [T]")
    if position_ids.dim() == 1:
        if position_ids.shape[0] != T:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected [{T}] "
                             f"for x {tuple(x.shape)}")
        position_ids = position_ids.unsqueeze(0)
    elif position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected [{B}, {T}] or [{T}]")
    if not theta > 0:
        raise ValueError(f"theta must be positive, got {theta}")

    dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least, float64 stays float64
    inv_freq = _inverse_frequencies(D, float(theta), x.device, dtype)  # [D/2]
    if impl == "auto" and dtype == torch.float32 and auto_uses_triton(x, "rope"):
        return imported_kernel("rope").triton_rotary(x, position_ids.to(x.device), inv_freq)
    freqs = position_ids.to(device=x.device, dtype=dtype).unsqueeze(-1) * inv_freq  # [B|1, T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B|1, T, 1, D]: broadcast over heads
    xf = x.to(dtype)
    half = D // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * angles.cos() + rotated * angles.sin()).to(x.dtype)


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(D: int, theta: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """theta^(-2i/D) for i < D/2, made once per head size and device: three launches fewer per layer
    call. Never an inference tensor, which a later training step could not use."""
    with torch.inference_mode(False):
        return theta ** (-torch.arange(0, D, 2, device=device, dtype=dtype) / D)

