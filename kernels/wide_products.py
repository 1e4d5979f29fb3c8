"""Matrix products of half-precision factors kept in a wider dtype: an fp32 weight gradient made from
bf16 activations and output gradients.

Autograd through an autocast cast (`weight.to(bf16)`) computes the weight's gradient in bf16 and then
casts it to fp32 in a pass of its own (read 2 bytes, write 4, per weight element and micro-batch), and
a product added to an fp32 accumulator is first written in bf16 and then read again. On CUDA the
matrix product can write fp32 from its fp32 accumulator at once (`torch.mm(..., out_dtype=)`,
`torch.addmm(..., out_dtype=)`): no pass and no rounding to bf16 between the product and the wider
result. Elsewhere (the CPU, a torch without these overloads) the product is made in the factors'
dtype and widened after, as autograd would.

Torch only: the PyTorch ops (projections, the SwiGLU's down projection) and the fused linear +
cross-entropy use it.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["product_in", "add_product_"]

_HALF = (torch.float16, torch.bfloat16)


def product_in(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b (2-D factors of one dtype) as a tensor of `dtype`."""
    if a.dtype == dtype:
        return a @ b
    if _widens_in_product(a, dtype):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b in place, acc of the factors' dtype or wider (an fp32 accumulator of bf16
    products); returns acc."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if _widens_in_product(a, acc.dtype):
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.add_(a @ b)


def _widens_in_product(a: torch.Tensor, dtype: torch.dtype) -> bool:
    return a.is_cuda and a.dtype in _HALF and dtype == torch.float32 and _cuda_widening_available(a.dtype)


@functools.cache
def _cuda_widening_available(dtype: torch.dtype) -> bool:
    """Whether this torch's CUDA mm/addmm take out_dtype for `dtype` factors (torch >= 2.8 on
    CUDA); asked once per dtype with a tiny product, as the overloads exist in every build's schema
    but are only implemented for some backends and dtypes."""
    try:
        a = torch.ones(16, 16, dtype=dtype, device="cuda")
        acc = torch.ones(16, 16, dtype=torch.float32, device="cuda")
        wide = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return wide.dtype == torch.float32 and bool((wide == 16).all()) and bool((acc == 17).all())
