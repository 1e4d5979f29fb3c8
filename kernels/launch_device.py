"""The device a Triton launch runs on: Triton launches on the current CUDA device, so a wrapper makes
it its tensor's (ranks may hold several devices). Torch only."""
from __future__ import annotations

import contextlib

import torch


def on_tensors_device(x: torch.Tensor):
    """A context in which kernels launch on x's CUDA device (nothing to do off CUDA)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
