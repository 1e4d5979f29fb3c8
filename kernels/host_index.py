"""Device copies of host index tensors (document boundaries), made once per tensor; whatever else ops
derive from the boundaries, kept per tensor the same way (`derived`); each token's document
(`document_ids`).

Torch only: the kernels' wrappers and the PyTorch ops both use it.
"""
from __future__ import annotations

import weakref

import torch

# id(index tensor) -> (weak reference to it, its version, {key: value}). Keyed by id: tensors cannot be
# dictionary keys by value (their == is elementwise).
_derived: dict = {}


def derived(index: torch.Tensor, key, make):
    """make(), computed once per index tensor (document boundaries) and `key`, and reused while the
    tensor lives unchanged: every layer of a row derives the same device copies, document starts and
    checks from one cu_seqlens, and each derivation costs the host several operators per layer (the
    host sets the pace of a step once a GPU's work is split: docs/benchmarks.md, "Host time"). An
    in-place change of the tensor (its version) or its release forgets what was derived."""
    entry = _derived.get(id(index))
    if entry is None or entry[0]() is not index or entry[1] != index._version:
        def forget(_: object, ident: int = id(index)) -> None:   # when the tensor is freed
            _derived.pop(ident, None)

        entry = _derived[id(index)] = (weakref.ref(index, forget), index._version, {})
    values: dict = entry[2]
    if key not in values:
        with torch.inference_mode(False):   # a value made in inference mode could not serve training
            values[key] = make()
    return values[key]


def on_device(index: torch.Tensor, device) -> torch.Tensor:
    """A device copy of a host index tensor (document boundaries), made once per tensor and reused by
    every layer: each copy from pageable host memory waits for the GPU to drain, which would stall
    the host once per layer."""
    device = torch.device(device)
    if index.device == device:
        return index
    return derived(index, ("on device", device), lambda: copy_to_device(index, device))


def document_ids(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    """The document of each of `tokens` tokens, on the boundaries' device: d with cu[d] <= t < cu[d + 1],
    found as the number of document ends at or before t."""
    return torch.searchsorted(cu[1:], torch.arange(tokens, device=cu.device), right=True)


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
