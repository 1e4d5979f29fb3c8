"""Causal depthwise short convolution (the kernel-4 conv in front of q, k, v of a GDN layer).

    y[t] = act(bias + sum_{i=0..W-1} weight[:, i] * x[t - (W-1) + i])

Tokens before the start of t's document count as zero, so packed documents never see each other.
The first document of a row may instead see `prefix`, the W-1 tokens before x[:, 0]: under context
parallelism that is the halo received from the previous rank (prefix[:, -1] is the token just
before x[:, 0]). Later documents of the row started on this rank, so they never see the prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from gdn_kernels.host_index import document_ids, on_device

from ...config import CONV_IMPLS
from ..triton_dispatch import auto_uses_triton, check_triton_input, kernel_module
from ..validation import check_cu_seqlens

__all__ = ["causal_conv1d", "causal_conv1d_naive", "check_conv_args", "resolve_impl"]

_ACTIVATIONS = (None, "silu", "swish")


def _triton_kernel():
    """The fused Triton conv (a function of its own so tests can count its calls)."""
    return kernel_module("short_conv").triton_causal_conv1d


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    if impl not in CONV_IMPLS:
        raise ValueError(f"impl must be one of {CONV_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if auto_uses_triton(x, "short_conv") else "torch"
    if impl == "triton":
        check_triton_input(x, "short_conv", "torch")
    return impl


def check_conv_args(x, weight, bias, activation, cu_seqlens, prefix):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor [B, T, D], got {getattr(x, 'shape', type(x).__name__)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    B, T, D = x.shape
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != D
            or weight.shape[1] < 1):
        raise ValueError(f"weight must be [D, W] = [{D}, W] (squeeze the [D, 1, W] nn.Conv1d weight), "
                         f"got {getattr(weight, 'shape', type(weight).__name__)}")
    _check_parameter_dtype("weight", weight, x)
    W = weight.shape[1]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (D,):
            raise ValueError(f"bias must be [D] = [{D}], got {getattr(bias, 'shape', type(bias).__name__)}")
        _check_parameter_dtype("bias", bias, x)
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias has dtype {bias.dtype} but weight has {weight.dtype}; give both one "
                             f"dtype")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if prefix is not None:
        if not isinstance(prefix, torch.Tensor) or tuple(prefix.shape) != (B, W - 1, D):
            raise ValueError(f"prefix must be [B, W-1, D] = [{B}, {W - 1}, {D}], "
                             f"got {getattr(prefix, 'shape', type(prefix).__name__)}")
        if prefix.dtype != x.dtype:
            raise ValueError(f"prefix has dtype {prefix.dtype} but x has {x.dtype}; cast them to one dtype")
    return check_cu_seqlens(cu_seqlens, B, T)


def _check_parameter_dtype(name: str, param: torch.Tensor, x: torch.Tensor) -> None:
    """x's dtype, or float32 beside half-precision x: an autocast run's master weight, used unrounded."""
    master = param.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)
    if param.dtype != x.dtype and not master:
        raise ValueError(f"{name} has dtype {param.dtype} but x has {x.dtype}; give it x's dtype "
                         f"(or float32 with float16/bfloat16 x)")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None,
                  prefix: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Vectorised causal depthwise conv on one device: x [B, T, D], weight [D, W] -> y [B, T, D]
    (x's dtype). weight and bias in x's dtype, or float32 beside fp16/bf16 x (an autocast run's master
    weights, passed without a cast per call): then the conv is computed in float32 and y rounded once.

    `impl`: "torch" (this file, runs anywhere), "triton" (the fused kernel of gdn_kernels.short_conv)
    or "auto" (triton for CUDA fp16/bf16/fp32 tensors when it imports, torch otherwise).
    """
    cu = check_conv_args(x, weight, bias, activation, cu_seqlens, prefix)
    if resolve_impl(impl, x) == "triton":
        return _triton_kernel()(x, weight, bias, activation, cu, prefix)
    if weight.dtype != x.dtype:   # float32 masters: computed in float32, as the kernel does
        wide_prefix = None if prefix is None else prefix.to(weight.dtype)
        y = causal_conv1d(x.to(weight.dtype), weight, bias, activation, cu, wide_prefix, impl="torch")
        return y.to(x.dtype)
    B, T, D = x.shape
    W = weight.shape[1]
    # Left context of the row: the prefix (halo) or zeros; everything else is masked per document.
    left = prefix if prefix is not None else x.new_zeros(B, W - 1, D)
    xp = torch.cat((left, x), dim=1)  # [B, W-1+T, D]; xp[:, t + W-1] = x[:, t]

    if cu is None:
        # One document per row: a plain depthwise conv over the padded row.
        y = F.conv1d(xp.transpose(1, 2), weight.unsqueeze(1), bias, groups=D).transpose(1, 2)
        return _activate(y, activation)

    # Packed documents: sum of W shifted copies; the copy shifted by s (token t-s, tap W-1-s) is
    # kept iff t-s is still in t's document, or t is in the first document (which sees the prefix).
    cu = on_device(cu, x.device)
    doc = document_ids(cu, T)
    pos = torch.arange(T, device=x.device) - cu[doc]
    first_doc = doc == 0
    y = x * weight[:, W - 1]  # s = 0: the token itself, always visible
    for s in range(1, W):
        keep = ((pos >= s) | first_doc).to(x.dtype).unsqueeze(-1)  # [T, 1]
        y = y + xp[:, W - 1 - s: W - 1 - s + T] * keep * weight[:, W - 1 - s]
    if bias is not None:
        y = y + bias
    return _activate(y, activation)


def causal_conv1d_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None,
                        prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Token-loop oracle of `causal_conv1d` (slow; for tests)."""
    cu = check_conv_args(x, weight, bias, activation, cu_seqlens, prefix)
    B, T, D = x.shape
    W = weight.shape[1]
    starts = [0] if cu is None else cu[:-1].tolist()
    rows = []
    for b in range(B):
        outs = []
        for t in range(T):
            start = max(st for st in starts if st <= t)  # start of t's document
            acc = bias.clone() if bias is not None else x.new_zeros(D)
            for i in range(W):
                src = t - (W - 1) + i
                if src >= start:
                    acc = acc + weight[:, i] * x[b, src]
                elif start == 0 and prefix is not None:  # first document looks into the halo
                    acc = acc + weight[:, i] * prefix[b, W - 1 + src]
            outs.append(_activate(acc, activation))
        rows.append(torch.stack(outs))
    return torch.stack(rows).to(x.dtype)
