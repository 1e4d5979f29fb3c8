"""The SwiGLU MLP's output projection, down(silu(gate) * up), keeping only gate and up for the backward.

Plain autograd keeps silu(gate) and the product (the down projection's input) as well: two more
[tokens, intermediate] tensors per layer, the widest activations of the model. Both are one
elementwise pass from gate and up, so the backward recomputes them:

    p = silu(gate) * up,   out = p W^T
    dW = dout^T p,   dp = dout W,   dgate = dp * up * silu'(gate),   dup = dp * silu(gate)
    silu'(g) = s (1 + g (1 - s)),  s = sigmoid(g)

`swiglu_down_reference` is the oracle: the same formula through plain autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight.to(gate.dtype))

    @staticmethod
    def backward(ctx, dout):
        # The same kernels and dtypes as autograd through the plain formula (products in the
        # activations' dtype, silu's derivative in aten's fused kernel), plus the recomputation.
        gate, up, weight = ctx.saved_tensors
        dout = dout.to(gate.dtype)
        silu = F.silu(gate)
        dweight = None
        if ctx.needs_input_grad[2]:
            product = silu * up
            dweight = dout.reshape(-1, dout.shape[-1]).t() @ product.reshape(-1, product.shape[-1])
            dweight = dweight.to(weight.dtype)
            del product
        dp = dout @ weight.to(gate.dtype)
        dgate = torch.ops.aten.silu_backward(dp * up, gate)
        dup = dp * silu
        return dgate, dup, dweight
