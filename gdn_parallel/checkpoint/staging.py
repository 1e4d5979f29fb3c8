"""Host copies of a rank's checkpoint share, made before DCP writes them.

A save copies the rank's share (state.py) into host buffers that the saver keeps from save to save
(pinned on a CUDA machine: allocated once, copied at full PCIe speed), then hands DCP those copies,
for a synchronous save and a background one alike. DCP's own staging copies the whole storage under
each tensor into new host memory every save, and refused a view of an FSDP2 shard ("invalid python
storage"). At h1-1.3b, cp = 4 (4 H100s), a save held the ranks ~25 s with whole gathered tensors
staged by DCP, ~11 s with shares in kept buffers (docs/benchmarks.md).
"""
from __future__ import annotations

import torch

from ..parallel.tensor import local_tensor


class HostStaging:
    """Host buffers for checkpoint tensors, reused while their key, shape and dtype stay the same."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every tensor (and DTensor's local piece) copied to the host; returns once the
        copies are complete, so training may change the originals right after."""
        from torch.distributed.tensor import DTensor
        staged: dict[str, torch.Tensor] = {}
        devices = set()
        for key, value in state.items():
            local = local_tensor(value)
            buffer = self._buffer(key, local)
            buffer.copy_(local, non_blocking=buffer.is_pinned())
            if local.is_cuda:
                devices.add(local.device)
            # DTensor.from_local would move a host tensor back to its mesh's device (a GPU copy of the
            # whole share, which the background writer then read back): the spec is taken as it is
            staged[key] = (DTensor(buffer, value._spec, requires_grad=False) if isinstance(value, DTensor)
                           else buffer)
        for device in devices:        # the asynchronous copies are done before anyone reads them
            torch.cuda.current_stream(device).synchronize()
        return staged

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
            self._buffers[key] = buffer
        return buffer


class AlreadyStaged:
    """DCP's stager for a state that is already on the host (HostStaging): hands it on as it is."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
