"""The SwiGLU MLP's output projection, down(silu(gate) * up), keeping only gate and up for the backward.

Plain autograd keeps silu(gate) and the product (the down projection's input) as well: two more
[tokens, intermediate] tensors per layer, the widest activations of the model. Both are one
elementwise pass from gate and up, so the backward recomputes them:

    p = silu(gate) * up,   out = p W^T
    dW = dout^T p,   dp = dout W,   dgate = dp * up * silu'(gate),   dup = dp * silu(gate)
    silu'(g) = s (1 + g (1 - s)),  s = sigmoid(g)

On CUDA the elementwise parts run as fused Triton kernels (gdn_kernels.swiglu: p in one pass,
dgate, dup and the recomputed p together in another, fp32 math inside); elsewhere, as the aten kernels below.

The weight is cast to the activations' dtype once per call, in the forward, and that copy is saved
for the backward (as autograd through F.linear under autocast would save it). Its gradient is made in
the weight's own dtype by the product itself where the device can (gdn_kernels.wide_products).

`swiglu_down_reference` is the oracle: the same formula through plain autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .projections import in_compute_dtype, weight_gradient
from .triton_dispatch import auto_uses_triton, imported_kernel


def swiglu_down_reference(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(gate) * up, weight)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T. gate, up [..., I] of one dtype; weight [D, I] is used in that dtype
    (under autocast the fp32 master weight is cast, as the down projection would be); its gradient
    comes back in the weight's own dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         f"must match in shape and dtype")
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [out, {gate.shape[-1]}]")
    with torch.autocast(gate.device.type, enabled=False):  # dtypes are settled here
        return _SwiGLUDown.apply(gate, up, weight)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if auto_uses_triton(gate, "swiglu"):
        return imported_kernel("swiglu").silu_mul(gate, up)
    return F.silu(gate) * up


def _silu_mul_backward(dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       with_product: bool) -> tuple[torch.Tensor, ...]:
    """(dgate, dup), and p = silu(gate) * up where asked; dp (a fresh product) may be overwritten."""
    if auto_uses_triton(gate, "swiglu"):
        return imported_kernel("swiglu").silu_mul_backward(dp, gate, up, with_product=with_product,
                                                           overwrite_dp=dp.is_contiguous())
    # the kernels and dtypes of autograd through the plain formula (products in the activations'
    # dtype, silu's derivative in aten's fused kernel)
    grads = (torch.ops.aten.silu_backward(dp * up, gate), dp * F.silu(gate))
    return (*grads, F.silu(gate) * up) if with_product else grads


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight):
        w16 = in_compute_dtype(weight, gate.dtype)  # the weight itself when the dtypes match
        ctx.save_for_backward(gate, up, w16)
        ctx.weight = weight   # a parameter: its gradient may be added in place (weight_gradient)
        return F.linear(_silu_mul(gate, up), w16)

    @staticmethod
    def backward(ctx, dout):
        gate, up, w16 = ctx.saved_tensors
        dout = dout.to(gate.dtype)
        wants_dweight = ctx.needs_input_grad[2]
        # p, recomputed rather than saved, comes out of the pass that makes dgate and dup
        dgate, dup, *product = _silu_mul_backward(dout @ w16, gate, up, with_product=wants_dweight)
        dweight = None
        if wants_dweight:
            p = product[0]
            rows = dout.reshape(-1, dout.shape[-1]).t(), p.reshape(-1, p.shape[-1])
            dweight = weight_gradient(ctx.weight, *rows)
        return dgate, dup, dweight
