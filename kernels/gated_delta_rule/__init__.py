"""Triton chunked gated delta rule: the GPU path of gdn_parallel.ops.gated_delta_rule (impl="triton").

Documents are laid out chunk-aligned (padded at their ends with state-preserving tokens) so that no
kernel ever sees a chunk that straddles two documents; only the sequential kernels need to know
where documents start. Between forward and backward only the UT inverse T ([Tp, HV, 64], input
dtype) is kept; the backward recomputes W, U, the chunk states and Delta (storing the states,
[chunks, HV, K, V], would cost twice the size of q, k and v together for every GDN layer).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton

from gdn_parallel.ops.gated_delta_rule.layout import build_layout

from . import backward as bwd
from . import forward as fwd
from .scan import ScanPlan, fold, plan_scan

CHUNK = 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
__all__ = ["triton_gated_delta_rule", "CHUNK"]


def triton_gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state: Optional[torch.Tensor] = None,
                            output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] (see gated_delta_rule for the meaning).

    Returns (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32 or None). Give `cu_seqlens`
    on the host (a CPU tensor or a list): read from the GPU it costs a device sync per call.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        lengths = (T,) * B
    else:
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    layout, plan = _layout_and_plan(lengths, v.device, TUNING["span_chunks"])
    flat = [layout.pad(x.reshape(B * T, *x.shape[2:])).flatten(0, 1) for x in (q, k, v, g, beta)]
    flat = [x.contiguous() for x in flat]
    o, final = _ChunkGatedDeltaRule.apply(*flat, initial_state, scale, plan, output_final_state)
    o = layout.unpad(o.view(layout.num_chunks, CHUNK, HV, V)).view(B, T, HV, V)
    return o, (final if output_final_state else None)


@functools.lru_cache(maxsize=64)
def _layout_and_plan(lengths: tuple, device: torch.device, span_chunks: int):
    """Built once per packing and reused by every layer: building them copies index tables to the
    device, and a copy from pageable host memory waits for the GPU to drain."""
    layout = build_layout(list(lengths), CHUNK, device)
    return layout, plan_scan(layout.doc_first_chunk, layout.doc_num_chunks, device, span_chunks)


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Every kernel output is allocated here, so a test can poison them all (NaN) and check each
    element gets written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _blocks(K: int, V: int):
    block_k = max(16, triton.next_power_of_2(K))
    block_v = max(16, min(64, triton.next_power_of_2(V)))
    return block_k, block_v


def _precision(x: torch.Tensor) -> str:
    return TUNING["inverse_precision"] if x.is_cuda else "ieee"


# Launch settings, chosen with tools/bench_kernels.py --tunings on an H200: value-block width, warps
# and pipelining depth of the sequential kernels; warps of the per-chunk backward kernels; the
# precision of the fp32 products of the UT inverse (3xTF32 keeps ~fp32 accuracy on tensor cores);
# chunks per span of the sequential walk (0: about sqrt(chunks), -1: whole documents; see scan.py).
# Spans are off by default: at H=16, K=V=128 on an H200 they cost more than they save (the walk is
# bound by the traffic of each step, which spans triple, not by its depth; docs/kernels.md).
TUNING = {"block_v": 32, "num_warps": 4, "num_stages": 3, "parallel_warps": 4, "inverse_precision": "tf32x3",
          "span_chunks": -1}


def _sequential_launch():
    return dict(num_warps=TUNING["num_warps"], num_stages=TUNING["num_stages"])


def _forward_pass(q, k, v, beta, gamma, t_inv, h0, plan: ScanPlan, want_final, compute_t):
    """W, U, chunk states, Delta (and the final states): shared by forward and the backward's recompute.
    With compute_t the UT inverse is computed into t_inv, otherwise read from it."""
    Tp, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    n = Tp // CHUNK
    BK, BV = _blocks(K, V)
    SBV = min(TUNING["block_v"], BV)
    w = _buffer((Tp, HV, K), k.dtype, k.device)
    u = _buffer(v.shape, v.dtype, v.device)
    fwd.ut_forward[(n, HV)](k, v, beta, gamma, t_inv, w, u, Tp, H, HV, K, V, CHUNK, BK, BV, 6, _precision(v),
                            compute_t)
    h = _buffer((n, HV, K, V), v.dtype, v.device)
    delta = _buffer(v.shape, v.dtype, v.device)
    if plan.spans:
        summary = _buffer((plan.num_spans, HV, K, K + V), torch.float32, v.device)
        fwd.span_summary_forward[(triton.cdiv(K + V, SBV), HV, plan.num_spans)](
            k, w, u, gamma, plan.span_first, plan.span_count, summary, Tp, H, HV, K, V, CHUNK, BK, SBV,
            _INTERPRET, **_sequential_launch())
        starts, final = fold(summary, plan, h0, V, False, _precision(v), _INTERPRET)
        fwd.state_forward[(triton.cdiv(V, SBV), HV, plan.num_spans)](
            k, w, u, gamma, plan.span_first, plan.span_count, starts, h, delta, starts, Tp,
            H, HV, K, V, CHUNK, BK, SBV, True, False, _INTERPRET, **_sequential_launch())
        return w, u, h, delta, (final if want_final else None)
    final = _buffer((plan.num_docs, HV, K, V), torch.float32, v.device) if want_final else delta
    fwd.state_forward[(triton.cdiv(V, SBV), HV, plan.num_docs)](
        k, w, u, gamma, plan.doc_first, plan.doc_count, h0 if h0 is not None else delta, h, delta, final, Tp,
        H, HV, K, V, CHUNK, BK, SBV, h0 is not None, want_final, _INTERPRET, **_sequential_launch())
    return w, u, h, delta, (final if want_final else None)


def _state_backward(q, k, w, gamma, do, dd_local, dfinal, plan: ScanPlan, scale, want_dh0):
    """dS' at every chunk's end (dh), the full dDelta (dd) and the initial-state gradients."""
    Tp, H, K = q.shape
    HV, V = do.shape[1], do.shape[2]
    n = Tp // CHUNK
    BK, BV = _blocks(K, V)
    SBV = min(TUNING["block_v"], BV)
    dh = _buffer((n, HV, K, V), do.dtype, do.device)
    dd = _buffer(do.shape, do.dtype, do.device)
    if plan.spans:
        summary = _buffer((plan.num_spans, HV, K, K + V), torch.float32, do.device)
        bwd.span_summary_backward[(triton.cdiv(K + V, SBV), HV, plan.num_spans)](
            q, k, w, gamma, do, dd_local, plan.span_first, plan.span_count, summary, scale, Tp, H, HV, K, V,
            CHUNK, BK, SBV, _INTERPRET, **_sequential_launch())
        ends, dh0 = fold(summary, plan, dfinal, V, True, _precision(do), _INTERPRET)
        bwd.state_backward[(triton.cdiv(V, SBV), HV, plan.num_spans)](
            q, k, w, gamma, do, dd_local, plan.span_first, plan.span_count, ends, dh, dd, ends, scale, Tp,
            H, HV, K, V, CHUNK, BK, SBV, True, False, _INTERPRET, **_sequential_launch())
        return dh, dd, (dh0 if want_dh0 else None)
    dh0 = _buffer((plan.num_docs, HV, K, V), torch.float32, do.device) if want_dh0 else None
    bwd.state_backward[(triton.cdiv(V, SBV), HV, plan.num_docs)](
        q, k, w, gamma, do, dd_local, plan.doc_first, plan.doc_count, dfinal if dfinal is not None else dd,
        dh, dd, dh0 if dh0 is not None else dd, scale, Tp, H, HV, K, V, CHUNK, BK, SBV, dfinal is not None,
        want_dh0, _INTERPRET, **_sequential_launch())
    return dh, dd, dh0


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """Flat chunk-aligned inputs [Tp, heads, D]; q/k may have fewer heads than v (grouped)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, plan, output_final_state):
        Tp, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        n = Tp // CHUNK
        # Cumulative log decay inside each chunk, head-major so a chunk's values are contiguous.
        gamma = g.float().view(n, CHUNK, HV).cumsum(1).view(Tp, HV).t().contiguous()
        h0c = None if h0 is None else h0.float().contiguous()
        t_inv = _buffer((Tp, HV, CHUNK), k.dtype, k.device)
        _, _, h, delta, final = _forward_pass(q, k, v, beta, gamma, t_inv, h0c, plan, output_final_state, True)
        BK, BV = _blocks(K, V)
        o = _buffer(v.shape, v.dtype, v.device)
        fwd.output_forward[(n, HV, triton.cdiv(V, BV))](q, k, h, delta, gamma, o, scale, Tp, H, HV, K, V,
                                                         CHUNK, BK, BV)
        ctx.save_for_backward(q, k, v, beta, gamma, t_inv, h0c)
        ctx.plan = plan
        ctx.scale, ctx.g_dtype, ctx.h0_dtype = scale, g.dtype, None if h0 is None else h0.dtype
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, beta, gamma, t_inv, h0 = ctx.saved_tensors
        Tp, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        n, G = Tp // CHUNK, HV // H
        BK, BV = _blocks(K, V)
        scale = ctx.scale
        do = do.contiguous()
        w, _, h, delta, _ = _forward_pass(q, k, v, beta, gamma, t_inv, h0, ctx.plan, False, False)
        dd_local = _buffer(v.shape, v.dtype, v.device)
        bwd.delta_grad_local[(n, HV, triton.cdiv(V, BV))](q, k, gamma, do, dd_local, scale, Tp, H, HV, K, V,
                                                           CHUNK, BK, BV)
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        dh, dd, dh0 = _state_backward(q, k, w, gamma, do, dd_local, dfinal, ctx.plan, scale, h0 is not None)
        dq = _buffer((Tp, HV, K), torch.float32, v.device)
        dk = _buffer(dq.shape, dq.dtype, dq.device)
        dw = _buffer((Tp, HV, K), k.dtype, v.device)
        dgamma = _buffer((HV, Tp), torch.float32, v.device)
        bwd.qkw_backward[(n, HV)](q, k, h, dh, delta, dd, do, gamma, dq, dk, dw, dgamma, scale, Tp,
                                  H, HV, K, V, CHUNK, BK, BV, num_warps=TUNING["parallel_warps"])
        dv = _buffer(v.shape, v.dtype, v.device)
        dbeta = _buffer((Tp, HV), torch.float32, v.device)
        bwd.ut_backward[(n, HV)](k, v, beta, gamma, t_inv, dw, dd, dk, dv, dbeta, dgamma, Tp, H, HV, K, V,
                                 CHUNK, BK, BV, num_warps=TUNING["parallel_warps"])
        # gamma = cumsum(g) inside each chunk, so dg_j = sum over i >= j of dgamma_i in that chunk.
        dg = dgamma.view(HV, n, CHUNK).flip(2).cumsum(2).flip(2).view(HV, Tp).t()
        if G > 1:  # value heads sharing a q/k head add their gradients
            dq, dk = dq.view(Tp, H, G, K).sum(2), dk.view(Tp, H, G, K).sum(2)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(ctx.g_dtype), dbeta.to(beta.dtype),
                None if dh0 is None else dh0.to(ctx.h0_dtype), None, None, None)
