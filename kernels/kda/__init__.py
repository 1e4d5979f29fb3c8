"""Triton chunked Kimi Delta Attention (KDA): the GPU path of gdn_parallel.ops.kda (impl="triton").

The gated delta rule with a log decay per key channel (docs/design.md §1; the chunk algebra is in
gdn_parallel/ops/kda/chunk.py). Documents are laid out chunk-aligned (kernels/chunk_layout.py), as for
the GDN kernels (gated_delta_rule/), whose loaders, UT-inverse pieces and launch ladder these reuse:
the kernels read q, k, v, g, beta and dO in the caller's unpadded rows and write O, dq, dk, dv, dg
and dbeta there; only their own buffers are padded. Within a chunk every product that carries a
decay is built on 16-token blocks through a reference decay (common.py), so no factor ever
overflows.

Kept from the forward for the backward: G and P(K) (fp32), T, scale P(Q), W, K o e^{G_C - G},
scale Q o e^G, the chunk states and Delta (input dtype): [Tp, HV] x (5K + 3C + V) + chunks x HV x K x V
values per layer.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from ..chunk_layout import ChunkLayout, build_layout
from ..gated_delta_rule import with_received_grad, with_received_state
from ..gated_delta_rule.launch import launch_fitting, setting_ladder, value_blocks
from ..gated_delta_rule.scan import ScanPlan, plan_scan
from . import backward as bwd
from . import forward as fwd
from .common import channel_group, diagonal_group, key_block

CHUNK = 64
MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
__all__ = ["triton_kimi_delta_attention", "CHUNK", "MAX_HEAD_DIM"]

# Launch settings. The sequential walks take the GDN kernels' first choices (gated_delta_rule/__init__.py,
# TUNING: value blocks of 32, 4 warps, 3 stages); the per-chunk kernels have warps of their own, set by
# ptxas spill counts for sm_90 and the timings below. channel_group: channels per [16, 16, channels]
# tile of the forward's exactly summed diagonal blocks (those that forget too fast to factor);
# diagonal_tile: values per [16, group, K] tile of the backward's.
# Where a device lacks the shared memory for a setting (K = 256, fp32 inputs), launch_fitting steps down
# to shallower pipelining and narrower value blocks.
# Measured on one H200 (16 heads, K = V = 128, 8 x 4096 tokens, bf16, Triton 3.6): qkw_backward 2.9 ms at
# 4 warps, 1.05 at 8; intra_backward 5.4 ms at 4 warps with [16, 4, 128] tiles, 23 ms at 8 warps with
# [16, 2, 128]; once its diagonal blocks factored, 3.34 ms at 4 or 8 warps with the exact sums compiled
# in (3.25 and 2.88 without them); decayed_products 1.26 ms at 4 warps, 1.32 at 8 (docs/kernels.md).
# intra_backward per 16-token block row (branch kda-backward-rows): not yet timed on a GPU.
TUNING = {"block_v": 32, "num_warps": 4, "num_stages": 3, "parallel_block_v": 64, "products_warps": 4,
          "ut_forward_warps": 4, "output_warps": 4, "qkw_warps": 8, "ut_warps": 4, "intra_warps": 4,
          "channel_group": 32, "diagonal_tile": 8192}


def triton_kimi_delta_attention(q, k, v, g, beta, *, scale: float, initial_state: torch.Tensor | None = None,
                                output_final_state: bool = False, cu_seqlens=None, relay=None):
    """Kimi Delta Attention on the Triton kernels, with autograd.

    q, k: [B, T, H, K] (L2-normalised by the caller); v: [B, T, HV, V] with HV a multiple of H (value
    head j reads q/k head j // (HV // H), in place); g: [B, T, HV, K], the activated log decay (<= 0);
    beta: [B, T, HV], activated. q, k and v share one dtype (fp32, fp16 or bf16); g and beta may be of
    any float dtype (read as fp32). cu_seqlens [N + 1] (a CPU tensor or list: read from the GPU it costs
    a sync) describes a packed row of N documents (B = 1); the state restarts at each. initial_state
    [N, HV, K, V] (N = B without cu_seqlens), fp32 preferred, gets its gradient.

    Returns (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32, or None unless
    output_final_state). The final states' gradient flows back through the kernels.

    relay (context parallelism; None otherwise): as gdn_kernels.gated_delta_rule's (receives, sends,
    receive_state, send_state, receive_state_grad, send_state_grad). If it receives, the first document's
    initial state comes from it (`initial_state` then holds the other documents', N - 1) after the
    state-independent chunk work, and its gradient goes back right after the backward walk; if it
    sends, the last document's final state goes out right after the forward walk, before the outputs,
    and its gradient is taken before the backward walk.

    Example (on CUDA)::

        q, k = (F.normalize(torch.randn(1, 200, 2, 128, device="cuda"), dim=-1).bfloat16() for _ in "qk")
        v = torch.randn(1, 200, 4, 128, device="cuda", dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(1, 200, 4, 128, device="cuda"))
        beta = torch.rand(1, 200, 4, device="cuda")
        o, final = triton_kimi_delta_attention(q, k, v, g, beta, scale=128 ** -0.5,
                                               output_final_state=True, cu_seqlens=[0, 120, 200])
    """
    B, T, H, K, HV, V = _check_inputs(q, k, v, g, beta, initial_state)
    lengths = _document_lengths(cu_seqlens, B, T)
    num_docs = len(lengths)
    given = num_docs - int(relay is not None and relay.receives)   # the relay brings the first one's
    if initial_state is not None and initial_state.shape[0] != given:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states but there are {given} "
                         f"sequences to start here; give one [HV, K, V] state per sequence (document)")
    layout, plan = _layout_and_plan(tuple(lengths), v.device)
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    if relay is not None and relay.receives and initial_state is None and num_docs > 1:
        initial_state = torch.zeros(num_docs - 1, HV, K, V, device=v.device)
    o, final = _ChunkKDA.apply(*flat, initial_state, scale, layout, plan, output_final_state, relay)
    return o.view(B, T, HV, V), (final if output_final_state else None)


def _check_inputs(q, k, v, g, beta, initial_state):
    """Shapes and dtypes the kernels take; returns (B, T, H, K, HV, V). Each error names the field."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            got = tuple(getattr(x, "shape", ())) or type(x).__name__
            raise ValueError(f"{name} must be a {rank}-D tensor, got {got}")
        if not x.is_floating_point() or x.dtype == torch.float64:
            raise ValueError(f"{name}: the Triton KDA kernels take fp32, fp16 or bf16, got {x.dtype}; use "
                             f"kimi_delta_attention(impl='chunk') for float64")
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}: they must match")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T) or HV % H:
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T} and HV a multiple of H = {H}, got "
                         f"{tuple(v.shape)}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head sizes must be <= {MAX_HEAD_DIM}: K = {K}, V = {V}; use impl='chunk'")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {[B, T, HV, K]} (one log decay per value head and key "
                         f"channel), got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {[B, T, HV]}, got {list(beta.shape)}")
    if len({x.device for x in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g and beta must be on one device")
    if initial_state is not None and (initial_state.dim() != 4
                                      or tuple(initial_state.shape[1:]) != (HV, K, V)):
        raise ValueError(f"initial_state must be [N, HV, K, V] = [N, {HV}, {K}, {V}], got "
                         f"{list(initial_state.shape)}")
    return B, T, H, K, HV, V


def _document_lengths(cu_seqlens, batch: int, tokens: int) -> list:
    if cu_seqlens is None:
        return [tokens] * batch
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if batch != 1 or bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {tokens} over one packed row (B = 1), got "
                         f"{bounds} with B = {batch}")
    return [b - a for a, b in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=64)
def _layout_and_plan(lengths: tuple, device: torch.device) -> tuple[ChunkLayout, ScanPlan]:
    """Built once per packing and reused by every layer (each build copies index tables to the device)."""
    layout = build_layout(list(lengths), CHUNK, device)
    return layout, plan_scan(layout.doc_first_chunk, layout.doc_num_chunks, device, -1)


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Every kernel output is allocated here, so a test can poison them all (NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _precision(x: torch.Tensor) -> str:
    """fp32 products of the UT inverse's block merges: ~fp32 accuracy (3xTF32) on a GPU, IEEE in the
    interpreter (as in the GDN kernels)."""
    return "tf32x3" if x.is_cuda else "ieee"


def _sequential_settings(V: int):
    return setting_ladder(value_blocks(V, TUNING["block_v"]), TUNING["num_warps"], TUNING["num_stages"])


def _parallel_settings(V: int, warps: str):
    """Per-chunk kernels: 3 stages is Triton's default depth; `warps` names the TUNING entry."""
    return setting_ladder(value_blocks(V, TUNING["parallel_block_v"]), TUNING[warps], 3)


def _block_row_settings(warps: str):
    """Kernels without value columns (decayed_products, intra_backward): warps and pipelining only;
    `warps` names the TUNING entry."""
    return [{"num_warps": TUNING[warps], "num_stages": s} for s in (2, 1)]


def _shape_key(keys, values):
    return (keys.shape[-1], values.shape[-1], keys.dtype, values.device)


class _ChunkKDA(torch.autograd.Function):
    """Flat inputs [tokens, heads, D], unpadded; q/k may have fewer heads than v (grouped)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, layout, plan, output_final_state, relay):
        Tp, K, HV, V = layout.padded_len, q.shape[2], v.shape[1], v.shape[2]
        n, dev, dt = Tp // CHUNK, v.device, k.dtype
        BK, key = key_block(K), _shape_key(k, v)
        cum = _buffer((Tp, HV, K), torch.float32, dev)
        t_inv, aqk = (_buffer((Tp, HV, CHUNK), dt, dev) for _ in range(2))
        pk = _buffer((Tp, HV, CHUNK), torch.float32, dev)   # fp32: A = diag(beta) P(K) is read back from it
        w, k_to_end = (_buffer((Tp, HV, K), dt, dev) for _ in range(2))
        u = _buffer((Tp, HV, V), dt, dev)
        launch_fitting(fwd.decayed_products, lambda s: (n, HV, CHUNK // 16),
                       (q, k, g, cum, aqk, pk, layout.chunk_rows, scale, q.shape[1], HV, K, CHUNK, BK),
                       _block_row_settings("products_warps"), key,
                       KC=channel_group(BK, TUNING["channel_group"]), PREC=_precision(v))
        launch_fitting(fwd.ut_forward, lambda s: (n, HV),
                       (k, v, beta, cum, t_inv, pk, w, u, k_to_end, layout.chunk_rows, q.shape[1], HV, K, V,
                        CHUNK, BK), _parallel_settings(V, "ut_forward_warps"), key, PREC=_precision(v))
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = with_received_state(h0, relay)    # after the chunk work above, which the wait overlapped
        sends = relay is not None and relay.sends
        h, delta, final = _walk(w, u, k_to_end, cum, h0, plan, output_final_state or sends)
        if sends:  # before the outputs: the next process's walk waits for this
            relay.send_state(final[-1:])
        o = _buffer(v.shape, v.dtype, dev)
        q_decayed = _buffer((Tp, HV, K), dt, dev)
        launch_fitting(fwd.output_forward, lambda s: (n, HV),
                       (q, cum, aqk, h, delta, o, q_decayed, layout.chunk_rows, scale, q.shape[1], HV, K, V,
                        CHUNK, BK), _parallel_settings(V, "output_warps"), key)
        ctx.save_for_backward(q, k, v, beta, h0, cum, t_inv, aqk, pk, w, k_to_end, q_decayed, h, delta)
        ctx.scale, ctx.layout, ctx.plan, ctx.g_dtype, ctx.relay = scale, layout, plan, g.dtype, relay
        return o, (final if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, beta, h0, cum, t_inv, aqk, pk, w, k_to_end, q_decayed, h, delta = ctx.saved_tensors
        layout, plan, scale = ctx.layout, ctx.plan, ctx.scale
        H, K, HV, V = q.shape[1], q.shape[2], v.shape[1], v.shape[2]
        Tp, total, dev, rows = layout.padded_len, q.shape[0], v.device, layout.chunk_rows
        n, group, BK, key = Tp // CHUNK, HV // H, key_block(K), _shape_key(k, v)
        do = do.contiguous()
        dd_local = _buffer((Tp, HV, V), v.dtype, dev)
        launch_fitting(bwd.delta_grad_local, lambda s: (n, HV), (aqk, do, dd_local, rows, HV, V, CHUNK),
                       _parallel_settings(V, "output_warps"), key)
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        relay = ctx.relay
        if relay is not None and relay.sends:  # everything before this ran while the gradient travelled
            dfinal = with_received_grad(dfinal, relay.receive_state_grad(), plan.num_docs)
        dh, dd, dh0 = _state_backward(q_decayed, cum, w, k_to_end, do, dd_local, rows, dfinal, plan,
                                      h0 is not None)
        if relay is not None and relay.receives:  # before the per-chunk gradients: rank r - 1 waits on it
            relay.send_state_grad(dh0[:1])
            dh0 = dh0[1:] if dh0.shape[0] > 1 else None
        del q_decayed
        del dd_local
        dq_part, dk_part, dcum = (_buffer((Tp, HV, K), torch.float32, dev) for _ in range(3))
        dw = _buffer((Tp, HV, K), k.dtype, dev)
        dpq, dpk = (_buffer((Tp, HV, CHUNK), torch.float32, dev) for _ in range(2))
        launch_fitting(bwd.qkw_backward, lambda s: (n, HV),
                       (q, k, cum, h, dh, delta, dd, do, dq_part, dk_part, dcum, dw, dpq, rows, scale, H, HV,
                        K, V, CHUNK, BK), _parallel_settings(V, "qkw_warps"), key)
        del dh
        dv = _buffer(v.shape, v.dtype, dev)
        dbeta = _buffer(beta.shape, beta.dtype, dev)
        launch_fitting(bwd.ut_backward, lambda s: (n, HV),
                       (k, v, beta, cum, t_inv, pk, dw, dd, dk_part, dcum, dv, dbeta, dpk, rows, H, HV, K, V,
                        CHUNK, BK), _parallel_settings(V, "ut_warps"), key)
        del dw, dd
        # Grouped value heads sum their q/k gradients in fp32; otherwise the kernel writes the input dtype.
        grad_dtype = q.dtype if group == 1 else torch.float32
        dq, dk = (_buffer((total, HV, K), grad_dtype, dev) for _ in range(2))
        dg = _buffer((total, HV, K), ctx.g_dtype, dev)
        launch_fitting(bwd.intra_backward, lambda s: (n, HV, CHUNK // 16),
                       (q, k, cum, dpq, dpk, dq_part, dk_part, dcum, dq, dk, rows, H, HV, K, CHUNK, BK),
                       _block_row_settings("intra_warps"), key,
                       JG=diagonal_group(BK, TUNING["diagonal_tile"]), PREC=_precision(v))
        launch_fitting(bwd.decay_backward, lambda s: (n, HV), (dcum, dg, rows, HV, K, CHUNK, BK),
                       _block_row_settings("intra_warps"), key)
        if group > 1:
            dq, dk = (x.view(total, H, group, K).sum(2).to(q.dtype) for x in (dq, dk))
        dh0 = None if dh0 is None or ctx.h0_dtype is None else dh0.to(ctx.h0_dtype)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


def _walk(w, u, k_to_end, cum, h0, plan: ScanPlan, want_final: bool):
    """Chunk-start states h, Delta and (want_final) the final states, from h0 (or zero)."""
    Tp, HV, K = w.shape
    V = u.shape[-1]
    n = Tp // CHUNK
    h = _buffer((n, HV, K, V), u.dtype, u.device)
    delta = _buffer(u.shape, u.dtype, u.device)
    final = _buffer((plan.num_docs, HV, K, V), torch.float32, u.device) if want_final else None
    launch_fitting(fwd.state_forward, lambda s: (triton.cdiv(V, s["BV"]), HV, plan.num_docs),
                   (w, u, k_to_end, cum, plan.doc_first, plan.doc_count, delta if h0 is None else h0, h,
                    delta, delta if final is None else final, HV, K, V, CHUNK, key_block(K)),
                   _sequential_settings(V), _shape_key(w, u),
                   HAS_H0=h0 is not None, HAS_FINAL=want_final, INTERPRET=_INTERPRET)
    return h, delta, final


def _state_backward(q_decayed, cum, w, k_to_end, do, dd_local, rows, dfinal, plan: ScanPlan, want_dh0: bool):
    """dS' at every chunk's end (dh), the full dDelta (dd) and the initial states' gradient (dh0)."""
    Tp, HV, K = w.shape
    V = do.shape[-1]
    n = Tp // CHUNK
    dh = _buffer((n, HV, K, V), do.dtype, do.device)
    dd = _buffer(dd_local.shape, do.dtype, do.device)
    dh0 = _buffer((plan.num_docs, HV, K, V), torch.float32, do.device) if want_dh0 else None
    launch_fitting(bwd.state_backward, lambda s: (triton.cdiv(V, s["BV"]), HV, plan.num_docs),
                   (q_decayed, cum, w, k_to_end, do, dd_local, rows, plan.doc_first, plan.doc_count,
                    dd if dfinal is None else dfinal, dh, dd, dd if dh0 is None else dh0, HV, K, V, CHUNK,
                    key_block(K)),
                   _sequential_settings(V), _shape_key(w, do),
                   HAS_DFINAL=dfinal is not None, HAS_DH0=want_dh0, INTERPRET=_INTERPRET)
    return dh, dd, dh0
