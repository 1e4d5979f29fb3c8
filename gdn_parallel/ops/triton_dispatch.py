"""When an op runs on the Triton kernels (`gdn_kernels`): one place for whether they import, which
dtypes they take and the CUDA-or-interpreter rule, shared by the GDN, conv and norm ops."""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

from ..config import ConfigError, ModelConfig

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp32 accumulation; float64 stays on PyTorch


class TritonUnavailable(ImportError, RuntimeError):
    """impl='triton' was asked for but triton or gdn_kernels does not import."""


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """gdn_kernels.<name>, or None when it (or triton) cannot be imported. Cached: "auto" asks per call.

    Without triton on a CPU machine that is expected and silent. Anything else (a GPU present, or a
    kernel module that fails for another reason) means impl="auto" quietly runs the PyTorch path where
    the kernels were meant to: that is said once, with the import error."""
    try:
        return importlib.import_module(f"gdn_kernels.{name}")
    except ImportError as err:
        triton_missing = getattr(err, "name", None) == "triton"
        if torch.cuda.is_available() or not triton_missing:
            warnings.warn(f"gdn_kernels.{name} does not import ({type(err).__name__}: {err}); impl='auto' "
                          f"runs the PyTorch path instead of the Triton kernels", RuntimeWarning,
                          stacklevel=2)
        return None


def imported_kernel(name: str) -> ModuleType:
    """gdn_kernels.<name> where the caller has checked that it imports (auto_uses_triton,
    check_triton_input): TritonUnavailable, naming the module, if it does not."""
    module = kernel_module(name)
    if module is None:
        raise TritonUnavailable(f"gdn_kernels.{name} does not import (triton or gdn_kernels is missing or "
                                f"broken): the Triton kernels cannot run here")
    return module


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


def check_gdn_kernels(model: ModelConfig, on_cuda: bool) -> None:
    """Gated DeltaNet's entry in the registry's kernel checks (model.mixers.check_kernels): that
    model.gdn_impl='triton' can run here at all, and the chunk length the kernels are built for."""
    _check_chunk_kernels(model, on_cuda, "gated_delta_rule", "gdn_impl", "gdn_chunk_size")
    # fp32 keys wider than 128 take the backward in key tiles (docs/kernels.md): they passed the GPU
    # tests on sm_90 (nvidia-h200, 2026-11-26), after about 6 minutes of compilation on first use.


def check_kda_kernels(model: ModelConfig, on_cuda: bool) -> None:
    """Kimi Delta Attention's entry: as GDN's, for model.kda_impl and model.kda_chunk_size."""
    _check_chunk_kernels(model, on_cuda, "kda", "kda_impl", "kda_chunk_size")


def check_attention_kernels(model: ModelConfig, on_cuda: bool) -> None:
    """Softmax attention's entry: a backward where it trains."""
    if model.attn_impl == "flex" and not on_cuda:
        raise ConfigError("model.attn_impl='flex' cannot train on the CPU: FlexAttention has no backward "
                          "there; set model.attn_impl=sdpa (or auto: sdpa on the CPU, flex on CUDA)")


def _check_chunk_kernels(model: ModelConfig, on_cuda: bool, name: str, impl_field: str, chunk_field: str):
    impl, chunk = getattr(model, impl_field), getattr(model, chunk_field)
    if impl == "triton" and not on_cuda:
        try:  # the op's own test, on an empty tensor standing for this CPU run
            check_triton_input(torch.empty(0), name, "chunk")
        except (ImportError, ValueError) as err:
            raise ConfigError(f"model.{impl_field}='triton' cannot run on the CPU: {err}") from None
    runs_kernels = impl == "triton" or (impl == "auto" and on_cuda)
    kernels = kernel_module(name) if runs_kernels else None
    if kernels is not None and chunk != kernels.CHUNK:
        raise ConfigError(f"model.{chunk_field}={chunk}: model.{impl_field}={impl!r} runs the Triton kernels "
                          f"here, which process chunks of {kernels.CHUNK} tokens; set "
                          f"model.{chunk_field}={kernels.CHUNK} or model.{impl_field}='chunk'")
