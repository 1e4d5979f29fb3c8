"""Triton chunked gated delta rule: the GPU path of gdn_parallel.ops.gated_delta_rule (impl="triton").

Documents are laid out chunk-aligned (padded at their ends with state-preserving tokens) so that no
kernel ever sees a chunk that straddles two documents; only the sequential kernels need to know where
documents start. The padding exists only in the kernels' own buffers: the first launch (gates.py)
reads the caller's q, k, g and beta through the layout's chunk table and writes them padded, and the
kernels read v and dO and write O and dv in the caller's unpadded rows. Between forward and backward
the UT inverse T ([Tp, HV, 64], input dtype) is kept, and by default W, the chunk states and Delta too
(TUNING["save_chunk_states"]; without it the backward recomputes them, one more forward walk).
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from ..chunk_layout import build_layout
from . import backward as bwd
from . import forward as fwd
from .gates import gate_backward, gate_forward
from .launch import launch_fitting, setting_ladder, value_blocks
from .scan import ScanPlan, fold, plan_scan

CHUNK = 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
__all__ = ["triton_gated_delta_rule", "CHUNK"]


def triton_gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                            decay_params=None, beta_activation: str | None = None,
                            use_qk_l2norm: bool = False, relay=None):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] (see gated_delta_rule for the meaning).

    In-kernel activations (gates.py): with decay_params = (A_log, dt_bias), [HV] each, g holds the
    raw logits a of the log decay -exp(A_log) * softplus(a + dt_bias); with beta_activation
    "sigmoid" or "2sigmoid", beta holds logits; with use_qk_l2norm, q and k are L2-normalised (eps
    1e-6). Their gradients come back to the raw inputs, A_log and dt_bias.

    Returns (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32 or None). Give `cu_seqlens`
    on the host (a CPU tensor or a list): read from the GPU it costs a device sync per call.

    relay (context parallelism; None otherwise): an object with attributes `receives`, `sends` and
    methods `receive_state() -> [1, HV, K, V]`, `send_state(s)`, `receive_state_grad() -> [1, HV, K, V]`,
    `send_state_grad(ds)`. If it receives, the first document's initial state comes from it (then
    `initial_state` holds only the other documents', N - 1 of them) and its gradient goes back to it
    right after the backward walk; if it sends, the last document's final state goes to it right
    after the forward walk, before the outputs, and its gradient is taken from it.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        lengths = (T,) * B
    else:
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    layout, plan = _layout_and_plan(lengths, v.device, TUNING["span_chunks"])
    flat_q, flat_k, flat_v, flat_g, flat_beta = (x.reshape(B * T, *x.shape[2:]).contiguous()
                                                 for x in (q, k, v, g, beta))
    if not use_qk_l2norm:  # the gate launch pads q and k only as it normalises them
        flat_q, flat_k = (layout.pad(x).flatten(0, 1).contiguous() for x in (flat_q, flat_k))
    A_log, dt_bias = (None, None) if decay_params is None else decay_params
    if relay is not None and relay.receives and initial_state is None and plan.num_docs > 1:
        initial_state = torch.zeros(plan.num_docs - 1, HV, K, V, device=v.device)
    o, final = _ChunkGatedDeltaRule.apply(flat_q, flat_k, flat_v, flat_g, flat_beta, initial_state, A_log,
                                          dt_bias, scale, plan, layout, output_final_state, beta_activation,
                                          use_qk_l2norm, relay)
    return o.view(B, T, HV, V), (final if output_final_state else None)


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


def _key_block(K: int) -> int:
    """Every kernel holds all K columns of a key or state row at once (K <= 256). At least 32: with
    16-column tiles and 16-bit inputs Triton 3.6 builds a ut_backward that reads past its shared
    memory on Hopper (compute-sanitizer, H200: K = 16, V = 32, bf16 and fp16); masked columns cost
    little at such small heads."""
    return max(32, triton.next_power_of_2(K))


def _precision(x: torch.Tensor) -> str:
    """fp32 products of the UT inverse's block merges and of the span fold: ~fp32 accuracy (3xTF32)
    on a GPU, where a single TF32 pass would round each product to 10 bits; IEEE in the interpreter."""
    return "tf32x3" if x.is_cuda else "ieee"


# Launch settings, chosen with tools/bench_kernels.py --tunings on an H200 (K = V = 128, bf16): value-block
# width, warps and pipelining depth of the sequential kernels; warps and value-block width of the per-chunk
# kernels; chunks per span of the sequential walk (0: about sqrt(chunks), -1: whole documents; see scan.py).
# They are the first choice: where a device lacks the shared memory for them (K = 256, fp32 inputs),
# launch.py steps down to shallower pipelining and narrower value blocks.
# Spans are off by default: at H=16, K=V=128 on an H200 they cost more than they save (the walk is
# bound by the traffic of each step, which spans triple, not by its depth; docs/kernels.md).
# save_chunk_states: keep W, the chunk states h and Delta (all in the input dtype, the very values the
# backward would recompute, so accuracy is the same) from the forward instead of recomputing them:
# ~17% less time for [T, HV] x (K + K*V/64 + V) more activation memory per layer (with activation
# checkpointing only the block being recomputed holds them). False trades the time back for memory.
# backward_key_block: key columns per tile of qkw_backward and ut_backward; 0: all of K, and half of it
# where the device cannot hold all (fp32 inputs at K = 256 need ~290-320 KB of shared memory whole).
TUNING = {"block_v": 32, "num_warps": 4, "num_stages": 3, "parallel_warps": 4, "parallel_block_v": 64,
          "span_chunks": -1, "save_chunk_states": True, "ut_forward_warps": 4, "backward_key_block": 0}


def _sequential_settings(V: int):
    return setting_ladder(value_blocks(V, TUNING["block_v"]), TUNING["num_warps"], TUNING["num_stages"])


def _parallel_settings(V: int, num_warps: int):
    """Per-chunk kernels; 3 stages is Triton's default depth."""
    return setting_ladder(value_blocks(V, TUNING["parallel_block_v"]), num_warps, 3)


def _key_split_settings(K: int, V: int, num_warps: int):
    """Per-chunk backward kernels: each setting with all key columns in one tile, then with half of
    them per tile (two passes over the key columns, the C x C products summed over both). Halving the
    key tile before the value block keeps fp32 at K = 256 at the value block and depth of fp32 at
    K = 128, and spares the compilation of settings that cannot fit either."""
    BK, forced = _key_block(K), TUNING["backward_key_block"]
    tiles = [forced] if forced else [BK] + ([BK // 2] if BK >= 64 else [])
    return [dict(s, KB=min(tile, BK)) for s in _parallel_settings(V, num_warps) for tile in tiles]


def _shape_key(keys, values):
    return (keys.shape[-1], values.shape[-1], keys.dtype, values.device)


def _chunk_factors(k, v, beta, gamma, t_inv, chunk_rows, compute_t):
    """W and U of every chunk: all the work that does not need the incoming state. With compute_t the
    UT inverse is computed into t_inv, otherwise read from it. v is the caller's, unpadded."""
    Tp, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    w = _buffer((Tp, HV, K), k.dtype, k.device)
    u = _buffer((Tp, HV, V), v.dtype, v.device)
    launch_fitting(fwd.ut_forward, lambda s: (Tp // CHUNK, HV),
                   (k, v, beta, gamma, t_inv, w, u, chunk_rows, Tp, H, HV, K, V, CHUNK, _key_block(K)),
                   _parallel_settings(V, TUNING["ut_forward_warps"]), _shape_key(k, v),
                   PREC=_precision(v), COMPUTE_T=compute_t)
    return w, u


def _walk_shape(keys, values):
    """(Tp, H, K, HV, V, chunks, key block) of a sequential kernel's launch."""
    Tp, H, K = keys.shape
    HV, V = values.shape[1], values.shape[2]
    return Tp, H, K, HV, V, Tp // CHUNK, _key_block(K)


def _walk(k, w, u, gamma, h0, plan: ScanPlan, want_final):
    """Chunk states h, Delta and (want_final) the final states, from the initial states h0 (or zero)."""
    Tp, H, K, HV, V, n, BK = _walk_shape(k, u)
    h = _buffer((n, HV, K, V), u.dtype, u.device)
    delta = _buffer(u.shape, u.dtype, u.device)
    settings, key = _sequential_settings(V), _shape_key(k, u)
    if plan.spans:
        summary = _buffer((plan.num_spans, HV, K, K + V), torch.float32, u.device)
        launch_fitting(fwd.span_summary_forward, lambda s: (triton.cdiv(K + V, s["BE"]), HV, plan.num_spans),
                       (k, w, u, gamma, plan.span_first, plan.span_count, summary, Tp, H, HV, K, V,
                        CHUNK, BK),
                       [_as_be(s) for s in settings], key, INTERPRET=_INTERPRET)
        starts, final = fold(summary, plan, h0, V, False, _precision(u), _INTERPRET)
        launch_fitting(fwd.state_forward, lambda s: (triton.cdiv(V, s["BV"]), HV, plan.num_spans),
                       (k, w, u, gamma, plan.span_first, plan.span_count, starts, h, delta, starts, Tp,
                        H, HV, K, V, CHUNK, BK), settings, key,
                       HAS_H0=True, HAS_FINAL=False, INTERPRET=_INTERPRET)
        return h, delta, (final if want_final else None)
    final = _buffer((plan.num_docs, HV, K, V), torch.float32, u.device) if want_final else delta
    launch_fitting(fwd.state_forward, lambda s: (triton.cdiv(V, s["BV"]), HV, plan.num_docs),
                   (k, w, u, gamma, plan.doc_first, plan.doc_count, h0 if h0 is not None else delta, h, delta,
                    final, Tp, H, HV, K, V, CHUNK, BK), settings, key,
                   HAS_H0=h0 is not None, HAS_FINAL=want_final, INTERPRET=_INTERPRET)
    return h, delta, (final if want_final else None)


def _as_be(setting: dict) -> dict:
    """The span-summary kernels call their column block BE (columns of [K | V], not of V alone)."""
    setting = dict(setting)
    setting["BE"] = setting.pop("BV")
    return setting


def _state_backward(q, k, w, gamma, do, dd_local, chunk_rows, dfinal, plan: ScanPlan, scale, want_dh0):
    """dS' at every chunk's end (dh), the full dDelta (dd) and the initial-state gradients. do is the
    caller's, unpadded."""
    Tp, H, K, HV, V, n, BK = _walk_shape(q, dd_local)
    dh = _buffer((n, HV, K, V), do.dtype, do.device)
    dd = _buffer(dd_local.shape, do.dtype, do.device)
    settings, key = _sequential_settings(V), _shape_key(q, do)
    if plan.spans:
        summary = _buffer((plan.num_spans, HV, K, K + V), torch.float32, do.device)
        launch_fitting(bwd.span_summary_backward,
                       lambda s: (triton.cdiv(K + V, s["BE"]), HV, plan.num_spans),
                       (q, k, w, gamma, do, dd_local, chunk_rows, plan.span_first, plan.span_count, summary,
                        scale, Tp, H, HV, K, V, CHUNK, BK), [_as_be(s) for s in settings], key,
                       INTERPRET=_INTERPRET)
        ends, dh0 = fold(summary, plan, dfinal, V, True, _precision(do), _INTERPRET)
        launch_fitting(bwd.state_backward, lambda s: (triton.cdiv(V, s["BV"]), HV, plan.num_spans),
                       (q, k, w, gamma, do, dd_local, chunk_rows, plan.span_first, plan.span_count, ends, dh,
                        dd, ends, scale, Tp, H, HV, K, V, CHUNK, BK), settings, key,
                       HAS_DFINAL=True, HAS_DH0=False, INTERPRET=_INTERPRET)
        return dh, dd, (dh0 if want_dh0 else None)
    dh0 = _buffer((plan.num_docs, HV, K, V), torch.float32, do.device) if want_dh0 else None
    launch_fitting(bwd.state_backward, lambda s: (triton.cdiv(V, s["BV"]), HV, plan.num_docs),
                   (q, k, w, gamma, do, dd_local, chunk_rows, plan.doc_first, plan.doc_count,
                    dfinal if dfinal is not None else dd, dh, dd, dh0 if dh0 is not None else dd, scale,
                    Tp, H, HV, K, V, CHUNK, BK), settings, key,
                   HAS_DFINAL=dfinal is not None, HAS_DH0=want_dh0, INTERPRET=_INTERPRET)
    return dh, dd, dh0


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """Flat inputs [tokens, heads, D], unpadded (q and k padded to the layout's [Tp, heads, D] when not
    normalised here); q/k may have fewer heads than v (grouped).

    With a `relay` (see StateRelay) the first document's initial state arrives from, and its
    gradient is sent back to, another process, and the last document's final state is sent on and
    its gradient received: each at the earliest moment the kernels allow."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, A_log, dt_bias, scale, plan, layout, output_final_state,
                beta_activation, use_qk_l2norm, relay):
        Tp, H, K = layout.padded_len, q.shape[1], q.shape[2]
        HV, V = v.shape[1], v.shape[2]
        n, rows = Tp // CHUNK, layout.chunk_rows
        # Cumulative log decay inside each chunk (head-major), and beta, activated here if asked.
        decay_params = None if A_log is None else (A_log, dt_bias)
        g_in, beta_in = g, beta
        # One launch for the activations (and the q/k L2 norm): nothing else to launch before the kernels.
        prepared = gate_forward(g, beta, decay_params, beta_activation, (q, k) if use_qk_l2norm else None,
                                layout=layout)
        gamma, beta = prepared[:2]
        rstd = None
        if use_qk_l2norm:
            q, k, rstd = prepared[2:]
        t_inv = _buffer((Tp, HV, CHUNK), k.dtype, k.device)
        w, u = _chunk_factors(k, v, beta, gamma, t_inv, rows, True)
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = with_received_state(h0, relay)
        sends = relay is not None and relay.sends
        h, delta, final = _walk(k, w, u, gamma, h0, plan, output_final_state or sends)
        if sends:  # before the outputs: the next process's walk waits for this
            relay.send_state(final[-1:])
        del u
        o = _buffer(v.shape, v.dtype, v.device)
        launch_fitting(fwd.output_forward, lambda s: (n, HV),
                       (q, k, h, delta, gamma, o, rows, scale, Tp, H, HV, K, V, CHUNK, _key_block(K)),
                       _parallel_settings(V, 4), _shape_key(q, v))
        kept = (w, h, delta) if TUNING["save_chunk_states"] else ()
        ctx.save_for_backward(q, k, v, beta, gamma, t_inv, h0, g_in, beta_in, A_log, dt_bias, rstd, *kept)
        ctx.plan, ctx.relay, ctx.scale, ctx.beta_activation = plan, relay, scale, beta_activation
        ctx.layout = layout
        return o, (final if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, beta, gamma, t_inv, h0, g_in, beta_in, A_log, dt_bias, rstd, *kept = ctx.saved_tensors
        Tp, H, K = q.shape   # q and k as the kernels read them: padded
        HV, V = v.shape[1], v.shape[2]
        n, G = Tp // CHUNK, HV // H
        BK, key = _key_block(K), _shape_key(q, v)
        scale, relay, plan, layout = ctx.scale, ctx.relay, ctx.plan, ctx.layout
        rows = layout.chunk_rows
        do = do.contiguous()
        if kept:
            w, h, delta = kept
        else:  # recompute W, U, the chunk states and Delta: the same bits the forward had
            w, u = _chunk_factors(k, v, beta, gamma, t_inv, rows, False)
            h, delta, _ = _walk(k, w, u, gamma, h0, plan, False)
            del u
        dd_local = _buffer((Tp, HV, V), v.dtype, v.device)
        launch_fitting(bwd.delta_grad_local, lambda s: (n, HV),
                       (q, k, gamma, do, dd_local, rows, scale, Tp, H, HV, K, V, CHUNK, BK),
                       _parallel_settings(V, 4), key)
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        if relay is not None and relay.sends:  # everything before this ran while the gradient travelled
            dfinal = with_received_grad(dfinal, relay.receive_state_grad(), plan.num_docs)
        dh, dd, dh0 = _state_backward(q, k, w, gamma, do, dd_local, rows, dfinal, plan, scale, h0 is not None)
        if relay is not None and relay.receives:  # before the per-chunk gradients: rank r - 1 waits on it
            relay.send_state_grad(dh0[:1])
            dh0 = dh0[1:] if dh0.shape[0] > 1 else None
        del dd_local
        # Without grouped heads dq and the finished dk are written in the input dtype at once (no cast
        # pass); grouped value heads sum theirs in fp32 first.
        dq = _buffer((Tp, HV, K), q.dtype if G == 1 else torch.float32, v.device)
        dk = _buffer((Tp, HV, K), torch.float32, v.device)
        dw = _buffer((Tp, HV, K), k.dtype, v.device)
        dgamma = _buffer((HV, Tp), torch.float32, v.device)
        launch_fitting(bwd.qkw_backward, lambda s: (n, HV),
                       (q, k, h, dh, delta, dd, do, gamma, dq, dk, dw, dgamma, rows, scale, Tp, H, HV, K, V,
                        CHUNK, BK),
                       _key_split_settings(K, V, TUNING["parallel_warps"]), key)
        del h, dh, delta
        dk_out = _buffer((Tp, HV, K), k.dtype, v.device) if G == 1 else dk
        dv = _buffer(v.shape, v.dtype, v.device)
        dbeta = _buffer((Tp, HV), torch.float32, v.device)
        launch_fitting(bwd.ut_backward, lambda s: (n, HV),
                       (k, v, beta, gamma, t_inv, dw, dd, dk, dk_out, dv, dbeta, dgamma, rows, Tp, H, HV, K,
                        V, CHUNK, BK),
                       _key_split_settings(K, V, TUNING["parallel_warps"]), key)
        dk = dk_out
        if G > 1:  # value heads sharing a q/k head add their gradients
            dq, dk = dq.view(Tp, H, G, K).sum(2), dk.view(Tp, H, G, K).sum(2)
        decay_params = None if A_log is None else (A_log, dt_bias)
        qk_norm = None if rstd is None else (q, k, rstd, dq, dk)
        dg, dbeta, dA_log, ddt_bias, *dqk = gate_backward(dgamma, dbeta, g_in, beta_in, decay_params,
                                                          ctx.beta_activation, qk_norm, layout=layout)
        if dqk:  # through the L2 norm, to the raw q and k
            dq, dk = dqk
        dh0_in = None if dh0 is None or ctx.h0_dtype is None else dh0.to(ctx.h0_dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g_in.dtype), dbeta.to(beta_in.dtype), dh0_in,
                None if A_log is None else dA_log.to(A_log.dtype),
                None if dt_bias is None else ddt_bias.to(dt_bias.dtype), None, None, None, None, None, None,
                None)


def with_received_state(h0, relay):
    """fp32 initial states, the relay's received one (if any) in front of the given ones."""
    h0 = None if h0 is None else h0.float().contiguous()
    if relay is None or not relay.receives:
        return h0
    incoming = relay.receive_state().float()
    return incoming.contiguous() if h0 is None else torch.cat([incoming, h0]).contiguous()


def with_received_grad(dfinal, received, num_docs):
    """Add the gradient of the last document's final state, received from the next process."""
    received = received.float()
    if dfinal is None:
        dfinal = received.new_zeros(num_docs, *received.shape[1:])
    return torch.cat([dfinal[:-1], dfinal[-1:] + received]).contiguous()
