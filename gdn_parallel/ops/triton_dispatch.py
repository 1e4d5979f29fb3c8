"""When an op runs on the Triton kernels (`gdn_kernels`): one place for whether they import, which
dtypes they take and the CUDA-or-interpreter rule, shared by the GDN, conv and norm ops."""
from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Optional

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp32 accumulation; float64 stays on PyTorch


class TritonUnavailable(ImportError, RuntimeError):
    """impl='triton' was asked for but triton or gdn_kernels does not import."""


@functools.lru_cache(maxsize=None)
def kernel_module(name: str) -> Optional[ModuleType]:
    """gdn_kernels.<name>, or None when it (or triton) cannot be imported. Cached: "auto" asks per call."""
    try:
        return importlib.import_module(f"gdn_kernels.{name}")
    except ImportError:
        return None


def auto_uses_triton(x: torch.Tensor, name: str) -> bool:
    """impl="auto": the kernels serve CUDA tensors of the dtypes they take, when they import."""
    return x.is_cuda and x.dtype in TRITON_DTYPES and kernel_module(name) is not None


def check_triton_input(x: torch.Tensor, name: str, fallback: str) -> ModuleType:
    """impl="triton" asked for explicitly: fail early with the fix; returns gdn_kernels.<name>.
    Imported afresh (not the cached probe) so that a package removed since is reported."""
    try:
        module = importlib.import_module(f"gdn_kernels.{name}")
    except ImportError as err:
        raise TritonUnavailable(f"impl='triton' needs triton and the gdn_kernels package ({err}); install "
                                f"'gdn-parallel[gpu]' or use impl='{fallback}' or 'auto'") from err
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"impl='triton' takes float32, float16 or bfloat16 inputs, got {x.dtype}; "
                         f"use impl='{fallback}' for float64")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to run Triton's "
                         f"interpreter on CPU); use impl='{fallback}' or 'auto'")
    return module
