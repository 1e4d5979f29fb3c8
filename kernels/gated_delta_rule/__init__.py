"""Triton chunked gated delta rule: the GPU path of gdn_parallel.ops.gated_delta_rule (impl="triton").

Documents are laid out chunk-aligned (padded at their ends with state-preserving tokens) so that no
kernel ever sees a chunk that straddles two documents; only the two sequential kernels need to know
where documents start. Nothing per chunk is kept between forward and backward: the backward
recomputes W, U, the chunk states and Delta (cheaper than storing [chunks, HV, K, V] at 1M tokens).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from gdn_parallel.ops.gated_delta_rule.layout import build_layout

from . import backward as bwd
from . import forward as fwd

CHUNK = 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
__all__ = ["triton_gated_delta_rule", "CHUNK"]


def triton_gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state: Optional[torch.Tensor] = None,
                            output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] (see gated_delta_rule for the meaning).

    Returns (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32 or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
    layout = build_layout(lengths, CHUNK, v.device)
    flat = [layout.pad(x.reshape(B * T, *x.shape[2:])).flatten(0, 1) for x in (q, k, v, g, beta)]
    flat = [x.contiguous() for x in flat]
    first = torch.tensor(layout.doc_first_chunk, dtype=torch.int32, device=v.device)
    count = torch.tensor(layout.doc_num_chunks, dtype=torch.int32, device=v.device)
    o, final = _ChunkGatedDeltaRule.apply(*flat, initial_state, scale, first, count, output_final_state)
    o = layout.unpad(o.view(layout.num_chunks, CHUNK, HV, V)).view(B, T, HV, V)
    return o, (final if output_final_state else None)


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Every kernel output is allocated here, so a test can poison them all (NaN) and check each
    element gets written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _blocks(K: int, V: int):
    block_k = max(16, triton.next_power_of_2(K))
    block_v = max(16, min(64, triton.next_power_of_2(V)))
    return block_k, block_v


def _precision(x: torch.Tensor) -> str:
    # The UT inverse multiplies fp32 matrices: 3xTF32 keeps ~fp32 accuracy on tensor cores.
    return "tf32x3" if x.is_cuda else "ieee"


# Launch settings of the two sequential kernels (value-block width, warps, pipelining depth).
SEQUENTIAL_TUNING = {"block_v": 64, "num_warps": 4, "num_stages": 2}


def _forward_pass(q, k, v, beta, gamma, t_inv, h0, first, count, want_final, compute_t):
    """W, U, chunk states, Delta (and the final states): shared by forward and the backward's recompute.
    With compute_t the UT inverse is computed into t_inv, otherwise read from it."""
    Tp, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    n, N = Tp // CHUNK, first.numel()
    BK, BV = _blocks(K, V)
    w = _buffer((Tp, HV, K), k.dtype, k.device)
    u = _buffer(v.shape, v.dtype, v.device)
    fwd.ut_forward[(n, HV)](k, v, beta, gamma, t_inv, w, u, Tp, H, HV, K, V, CHUNK, BK, BV, 6, _precision(v),
                            compute_t)
    h = _buffer((n, HV, K, V), v.dtype, v.device)
    delta = _buffer(v.shape, v.dtype, v.device)
    final = _buffer((N, HV, K, V), torch.float32, v.device) if want_final else delta
    SBV = min(SEQUENTIAL_TUNING["block_v"], BV)
    fwd.state_forward[(triton.cdiv(V, SBV), HV, N)](
        k, w, u, gamma, first, count, h0 if h0 is not None else delta, h, delta, final, Tp,
        H, HV, K, V, CHUNK, BK, SBV, h0 is not None, want_final, _INTERPRET,
        num_warps=SEQUENTIAL_TUNING["num_warps"], num_stages=SEQUENTIAL_TUNING["num_stages"])
    return w, u, h, delta, (final if want_final else None)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """Flat chunk-aligned inputs [Tp, heads, D]; q/k may have fewer heads than v (grouped)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, first, count, output_final_state):
        Tp, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        n = Tp // CHUNK
        # Cumulative log decay inside each chunk, head-major so a chunk's values are contiguous.
        gamma = g.float().view(n, CHUNK, HV).cumsum(1).view(Tp, HV).t().contiguous()
        h0c = None if h0 is None else h0.float().contiguous()
        t_inv = _buffer((Tp, HV, CHUNK), k.dtype, k.device)
        _, _, h, delta, final = _forward_pass(q, k, v, beta, gamma, t_inv, h0c, first, count,
                                              output_final_state, True)
        BK, BV = _blocks(K, V)
        o = _buffer(v.shape, v.dtype, v.device)
        fwd.output_forward[(n, HV, triton.cdiv(V, BV))](q, k, h, delta, gamma, o, scale, Tp, H, HV, K, V,
                                                         CHUNK, BK, BV)
        ctx.save_for_backward(q, k, v, beta, gamma, t_inv, h0c, first, count)
        ctx.scale, ctx.g_dtype, ctx.h0_dtype = scale, g.dtype, None if h0 is None else h0.dtype
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, beta, gamma, t_inv, h0, first, count = ctx.saved_tensors
        Tp, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        n, N, G = Tp // CHUNK, first.numel(), HV // H
        BK, BV = _blocks(K, V)
        scale = ctx.scale
        do = do.contiguous()
        w, _, h, delta, _ = _forward_pass(q, k, v, beta, gamma, t_inv, h0, first, count, False, False)
        dd_local = _buffer(v.shape, v.dtype, v.device)
        bwd.delta_grad_local[(n, HV, triton.cdiv(V, BV))](q, k, gamma, do, dd_local, scale, Tp, H, HV, K, V,
                                                           CHUNK, BK, BV)
        dh = _buffer((n, HV, K, V), v.dtype, v.device)
        dd = _buffer(v.shape, v.dtype, v.device)
        dh0 = _buffer((N, HV, K, V), torch.float32, v.device) if h0 is not None else None
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        SBV = min(SEQUENTIAL_TUNING["block_v"], BV)
        bwd.state_backward[(triton.cdiv(V, SBV), HV, N)](
            q, k, w, gamma, do, dd_local, first, count, dfinal if dfinal is not None else dd, dh, dd,
            dh0 if dh0 is not None else dd, scale, Tp, H, HV, K, V, CHUNK, BK, SBV, dfinal is not None,
            dh0 is not None, _INTERPRET,
            num_warps=SEQUENTIAL_TUNING["num_warps"], num_stages=SEQUENTIAL_TUNING["num_stages"])
        dq = _buffer((Tp, HV, K), torch.float32, v.device)
        dk = _buffer(dq.shape, dq.dtype, dq.device)
        dw = _buffer((Tp, HV, K), k.dtype, v.device)
        dgamma = _buffer((HV, Tp), torch.float32, v.device)
        bwd.qkw_backward[(n, HV)](q, k, h, dh, delta, dd, do, gamma, dq, dk, dw, dgamma, scale, Tp,
                                  H, HV, K, V, CHUNK, BK, BV)
        dv = _buffer(v.shape, v.dtype, v.device)
        dbeta = _buffer((Tp, HV), torch.float32, v.device)
        bwd.ut_backward[(n, HV)](k, v, beta, gamma, t_inv, dw, dd, dk, dv, dbeta, dgamma, Tp, H, HV, K, V,
                                 CHUNK, BK, BV)
        # gamma = cumsum(g) inside each chunk, so dg_j = sum over i >= j of dgamma_i in that chunk.
        dg = dgamma.view(HV, n, CHUNK).flip(2).cumsum(2).flip(2).view(HV, Tp).t()
        if G > 1:  # value heads sharing a q/k head add their gradients
            dq, dk = dq.view(Tp, H, G, K).sum(2), dk.view(Tp, H, G, K).sum(2)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(ctx.g_dtype), dbeta.to(beta.dtype),
                None if dh0 is None else dh0.to(ctx.h0_dtype), None, None, None, None)
