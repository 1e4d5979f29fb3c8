"""Device copies of host index tensors (document boundaries), made once per tensor.

Torch only: the kernels' wrappers and the PyTorch ops both use it.
"""
from __future__ import annotations

import weakref

import torch

# id(host tensor) -> (weak reference to it, its version, device copy). Keyed by id: tensors cannot be
# dictionary keys by value (their == is elementwise).
_device_copies: dict = {}


def on_device(index: torch.Tensor, device) -> torch.Tensor:
    """A device copy of a host index tensor (document boundaries), made once per tensor and reused by
    every layer: each copy from pageable host memory waits for the GPU to drain, which would stall
    the host once per layer."""
    device = torch.device(device)
    if index.device == device:
        return index
    key = id(index)
    entry = _device_copies.get(key)
    if entry is None or entry[0]() is not index or entry[1] != index._version or entry[2].device != device:
        def forget(_: object, key: int = key) -> None:   # when the host tensor is freed
            _device_copies.pop(key, None)

        ref = weakref.ref(index, forget)
        entry = _device_copies[key] = (ref, index._version, copy_to_device(index, device))
    return entry[2]


def copy_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """`host` copied to `device` without the host waiting: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory first waits for the GPU to drain; the caching host
    allocator keeps the pinned buffer until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


ALIGN_BYTES = 16   # Triton specializes a pointer argument on 16-byte alignment: one compiled variant each way


def packed_on_device(parts: list, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Several host index arrays in one host-to-device copy, each returned as its own 1-D view that
    starts 16-byte aligned. Slices at offsets that depend on the data (the number of documents in a
    step) would be aligned at some steps and not at others, and every kernel taking them would be
    compiled again in the middle of training, seconds a kernel (docs/kernels.md)."""
    step = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    host = [torch.as_tensor(part, dtype=dtype).reshape(-1) for part in parts]
    padded = [-(-t.numel() // step) * step for t in host]
    flat = torch.cat([torch.cat([t, t.new_zeros(width - t.numel())]) for t, width in zip(host, padded)])
    pieces = copy_to_device(flat, device).split(padded)
    return [piece[:t.numel()] for piece, t in zip(pieces, host)]
