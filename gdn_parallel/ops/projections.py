"""Several linear projections of one input, whose gradients with respect to that input are summed
inside the matrix products.

A GDN layer reads its normalised input through six projections (q, k, v, a, b, g), an attention layer
through three or four, the MLP through two. Through autograd each projection's backward writes its
own dx_i = dy_i W_i and autograd then adds them up: five more passes over a [tokens, hidden] tensor in
a GDN layer (9.6 ms of a 330 ms gdn-0.4b step on an H100). Here the backward runs the first product
into dx and each later one as dx += dy_i W_i, the sum done by the product itself (addmm with beta = 1):
the same products and no separate additions. The forward is unchanged, one product per projection,
since the consumers want their inputs as separate contiguous tensors.

Under autocast each weight is cast to the autocast dtype once per call (as autocast would cast it) and
that copy is saved for the backward. The weights' gradients come back in their own dtype: on CUDA an
fp32 master weight's gradient is written in fp32 by its product (gdn_kernels.wide_products), with no
cast pass after it. A single projection takes the same path (`linear`), for that last reason.
`project_reference` is the oracle: the projections called one by one through autograd.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from gdn_kernels.wide_products import product_in
from torch import nn


def project_reference(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    return [linear(x) for linear in linears]


def project(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """[linear(x) for linear in linears], the input's gradient accumulated in the products' epilogue.

    Plain bias-free nn.Linear modules take the fused backward; anything else (a bias, a module that
    computes only part of its weight, such as tensor parallelism's ReplicatedHeadLinear) is called as is."""
    if not linears or not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return project_reference(x, *linears)
    masters = [cast(nn.Linear, m).weight for m in linears]
    dtype = _compute_dtype(x, masters)
    if dtype is None:
        return project_reference(x, *linears)
    # Input and weights enter the products in `dtype`, autocast's own where it is on, so autocast
    # changes nothing inside and is left on: entering a context to switch it off cost the host more
    # than the cast checks it saves (a context per projection call, dozens a step).
    return list(_SharedInputLinears.apply(x.to(dtype), dtype, *masters))


def linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """module(x) for one projection, through `project` (its weight's gradient in the weight's dtype
    straight from the product)."""
    return project(x, module)[0]


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves fp64 alone


def _compute_dtype(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype F.linear computes in: autocast's where it is on for x's device and casts these
    tensors, else their common dtype; None where they have none (F.linear then raises its own error)."""
    tensors = [x, *weights]
    if torch.is_autocast_enabled(x.device.type) and all(t.dtype in _AUTOCAST_CASTS for t in tensors):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype if all(t.dtype == x.dtype for t in tensors) else None


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, *masters):
        ctx.set_materialize_grads(False)  # an unused output sends no gradient: its products are skipped
        weights = [w.to(dtype) for w in masters]  # the masters themselves where the dtypes match
        ctx.save_for_backward(x, *weights)
        ctx.master_dtypes = [w.dtype for w in masters]
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x_rows = x.reshape(-1, x.shape[-1])
        dx = None
        dweights: list[torch.Tensor | None] = []
        for i, (grad, weight) in enumerate(zip(grads, weights)):
            if grad is None:
                dweights.append(None)
                continue
            grad_rows = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = grad_rows @ weight if dx is None else dx.addmm_(grad_rows, weight)
            wanted = ctx.needs_input_grad[2 + i]
            dweights.append(product_in(grad_rows.t(), x_rows, ctx.master_dtypes[i]) if wanted else None)
        return (None if dx is None else dx.view(x.shape)), None, *dweights
