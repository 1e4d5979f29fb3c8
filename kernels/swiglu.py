"""Fused SwiGLU elementwise work in Triton: the product that feeds the MLP's down projection and
its gradient, each one pass over memory.

With s = sigmoid(g) and silu(g) = g s:

    forward:   p = silu(g) * u
    backward:  dgate = dp * u * silu'(g),   silu'(g) = s (1 + g (1 - s))
               dup   = dp * g * s

The aten forms take a kernel per operation (silu, then the multiply; in the backward dp * up,
silu_backward and dp * silu), each reading and writing a full [tokens, intermediate] tensor and
rounding between them. Here the forward reads g, u and writes p; the backward reads dp, g, u and
writes dgate, dup, and p again where asked (`with_product`: the down projection's weight gradient
needs p, which is recomputed rather than kept from the forward; made here it costs one more write
instead of another pass over g and u). dgate may be written over dp (`overwrite_dp`: each element is
read before it is written), so the backward holds no more tensors than before. Math is fp32 whatever
the input dtype, rounded once into it, so the results are not bit-identical to the aten forms in bf16
(they round less).

Layout: tensors are flat (any shape, contiguous); a program covers BLOCK consecutive elements, 8
per thread at NUM_WARPS warps, i.e. one 16-byte load per bf16 tensor. Plain functions, no
autograd: `gdn_parallel.ops.swiglu.swiglu_down` calls them from its autograd Function and
validates its arguments. Deterministic: no reductions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_device import on_tensors_device

__all__ = ["silu_mul", "silu_mul_backward"]

# Fixed tiles (no autotune: the CPU interpreter would run every config).
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _silu_mul_fwd(G, U, P, N, BLOCK: tl.constexpr):
    # int64 offsets: tokens x intermediate passes 2^31 at long sequences
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(P + offs, (g * tl.sigmoid(g) * u).to(P.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(DP, G, U, DG, DU, P, N, BLOCK: tl.constexpr, WITH_PRODUCT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dp = tl.load(DP + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dp * u * s * (1.0 + g * (1.0 - s))
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dp * g * s).to(DU.dtype.element_ty), mask=mask)
    if WITH_PRODUCT:
        tl.store(P + offs, (g * s * u).to(P.dtype.element_ty), mask=mask)


def _check(*tensors: torch.Tensor) -> None:
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors[1:]):
        raise ValueError("silu_mul tensors must match in shape and dtype, got "
                         + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise, fp32 math, in the inputs' dtype and shape."""
    _check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()  # no-ops for the projections' outputs
    p = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        with on_tensors_device(gate):
            _silu_mul_fwd[(triton.cdiv(n, BLOCK),)](gate, up, p, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return p


def silu_mul_backward(dp: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, with_product: bool = False,
                      overwrite_dp: bool = False) -> tuple[torch.Tensor, ...]:
    """(dgate, dup) of p = silu(gate) * up given dp, in one pass; fp32 math, in the inputs' dtype.
    with_product: (dgate, dup, p), p as silu_mul makes it. overwrite_dp: dgate is written into dp
    (contiguous dp only; its values are gone after)."""
    _check(dp, gate, up)
    if overwrite_dp and not dp.is_contiguous():
        raise ValueError("silu_mul_backward(overwrite_dp=True) needs a contiguous dp")
    dp, gate, up = dp.contiguous(), gate.contiguous(), up.contiguous()
    dgate = dp if overwrite_dp else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    p = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if with_product else dup
    n = gate.numel()
    if n:
        with on_tensors_device(gate):
            _silu_mul_bwd[(triton.cdiv(n, BLOCK),)](dp, gate, up, dgate, dup, p, n, BLOCK=BLOCK,
                                                    WITH_PRODUCT=with_product, num_warps=NUM_WARPS)
    return (dgate, dup, p) if with_product else (dgate, dup)
