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
that copy is saved for the backward; inside `weights_cast_once` (the micro-batches of one training step)
once for all of them. The weights' gradients come back in their own dtype: on CUDA an fp32 master
weight's gradient is written in fp32 by its product (gdn_kernels.wide_products), with no cast pass after
it; inside `gradients_accumulated_in_place` a weight that already holds a gradient gets this call's
added to it by the product itself. A single projection takes the same path (`linear`), for its weight's
gradient.
`project_reference` is the oracle: the projections called one by one through autograd.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
import torch.nn.functional as F
from gdn_kernels.wide_products import add_product_, product_in
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


# master weight id -> (master, its copy in a compute dtype), while weights_cast_once is entered
_shared_casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = None


@contextlib.contextmanager
def weights_cast_once() -> Iterator[None]:
    """Inside, `project` casts each master weight to a compute dtype once and every later call reuses
    that copy: for the micro-batches of one training step, whose weights do not change between them.
    Each cast is a launch and a pass over the weight per projection and micro-batch (a fifth of a
    GDN-H1 layer's launches): where the host sets the pace of a step, fewer of them is time. The copies
    live until the exit; without activation checkpointing each is saved for the backward of every
    micro-batch anyway, so the peak does not grow."""
    global _shared_casts
    outer = _shared_casts
    _shared_casts = {} if outer is None else outer
    try:
        yield
    finally:
        _shared_casts = outer


# whether gradients_accumulated_in_place is entered
_accumulating_in_place = False


@contextlib.contextmanager
def gradients_accumulated_in_place() -> Iterator[None]:
    """Inside, a weight whose `.grad` already holds an earlier micro-batch's gradient (same shape and
    dtype, contiguous) gets this one's added into it by the product (addmm, fp32 out of bf16 factors on
    CUDA), and autograd is handed no gradient for it: no accumulation pass after the product (a launch
    and a read, add and write of the fp32 gradient per weight and micro-batch). Only where nothing
    watches gradients arrive: DDP and FSDP2 reduce from hooks on autograd's accumulation."""
    global _accumulating_in_place
    outer = _accumulating_in_place
    _accumulating_in_place = True
    try:
        yield
    finally:
        _accumulating_in_place = outer


def weight_gradient(master: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b, the gradient of `master`, for an autograd Function's backward to return: a new tensor
    in master's dtype, or None once added into master.grad (inside gradients_accumulated_in_place)."""
    held = master.grad
    if (_accumulating_in_place and held is not None and held.dtype == master.dtype
            and held.shape == master.shape and held.is_contiguous() and not held.requires_grad):
        add_product_(held, a, b)
        return None
    return product_in(a, b, master.dtype)


def in_compute_dtype(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """master in `dtype`: itself, the copy shared inside weights_cast_once, or a new copy. Data only,
    for an autograd Function's forward that returns the master's gradient itself."""
    if master.dtype == dtype:
        return master
    if _shared_casts is None:
        return master.to(dtype)
    entry = _shared_casts.get((id(master), dtype))
    if entry is None or entry[0] is not master:
        entry = _shared_casts[(id(master), dtype)] = (master, master.to(dtype))
    return entry[1]


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
        weights = [in_compute_dtype(w, dtype) for w in masters]  # the masters themselves where they match
        ctx.save_for_backward(x, *weights)
        ctx.masters = masters   # parameters, alive anyway: their gradients may be added in place
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
            dweights.append(weight_gradient(ctx.masters[i], grad_rows.t(), x_rows) if wanted else None)
        return (None if dx is None else dx.view(x.shape)), None, *dweights
