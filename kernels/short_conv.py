"""Fused causal depthwise short convolution + SiLU in Triton (forward and backward).

Per channel, with kernel width W and tap i reading the token s = W-1-i steps back:

    z[t] = bias + sum_i w[i] * x[t - s]        y[t] = act(z[t])

A source position u is visible from token q iff u >= lo[q]: lo is the start of q's document, except
that the first document of the row (start 0) reaches back to -(W-1) when a `prefix` (the context
parallel halo) is given; x[u] for u < 0 is read from prefix[W-1+u].

The backward recomputes z from the inputs (nothing but the inputs is saved) and, with
dz = dy * act'(z), runs in two passes: the first computes dz (written in dy's dtype, rounding as dy
itself was rounded) with dw and dbias; the second computes dx from dz:

    dx[u]  = sum_s w[W-1-s] * dz[u+s]  over the u+s that see u   (the conv run in reverse)
    dw[i]  = sum_t dz[t] * x[t-s]       dbias = sum_t dz[t]
    dprefix[W-1+u] = dx[u] for u = -(W-1)..-1, with the same formula.

A single pass that recomputed dz at each of the W tokens reading a position (W^2 loads of x and a
cross-thread reduction per tile) took 54 ms of a gdn-1.3b step on an H100; the two passes take 32
(tools/bench_block_kernels.py times both). dw and dbias are reduced per chunk of tokens in fp32
registers, written as partial sums and summed by torch: deterministic, no atomics. For W <= 4 the
first pass keeps one dw accumulator per tap and loads each shifted x tile once, for z and dw alike:
1.7x faster on an H200 (2048 channels) than one [W, ...] accumulator updated through a select per tap
with x loaded twice, which wider kernels still use. The weight and bias are read in fp32 whatever
their dtype: an autocast run passes its fp32 master weights as they are, with no cast per call, and gets
their gradients in fp32 from the sums. Arguments are validated by
`gdn_parallel.ops.short_conv.causal_conv1d`; this module trusts them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_index import derived, document_ids, on_device
from .launch_device import on_tensors_device

__all__ = ["triton_causal_conv1d"]

# Fixed tiles (no autotune: the CPU interpreter would run every config). A tile of 32 tokens x 64
# channels is 16 elements per thread at 4 warps; bf16 rows of 64 channels are 128-byte loads.
BLOCK_T = 32
BLOCK_D = 64
# Backward pass 1 (dz, dw, dbias): tokens per program, so dw partial sums are [T / CHUNK_T, D, W] fp32
# (8 MB at T=64K, D=2K), and its token tile. A thread holds W + 1 accumulator tiles and the W x tiles
# in registers: at 32 tokens that is about 240 registers (2 programs per SM); 16 tokens (128-170) ran
# the 2048-channel conv with bias and prefix 1.14x faster on an H200, and as fast without them.
CHUNK_T = 256
DZ_BLOCK_T = 16
DZ_WARPS = 4
# Token tiles per program of the forward and of backward pass 2 (dx). The W weight columns are
# strided gathers, each thread loading its own channels' values again; a program that runs several
# tiles loads them once for all. With one tile a program, an fp32 weight made both kernels 1.3x
# slower than a bf16 one (H200, 4 x 4096 tokens); at 4 tiles both run at or below bf16's old time.
TILES_PER_PROGRAM = 4


@triton.jit
def _lowest_visible(start_ptr, q, q_ok, HAS_CU: tl.constexpr, LO: tl.constexpr):
    """lo[q]: the first source position token q may read (LO = -(W-1) with a prefix, else 0)."""
    lo = tl.zeros_like(q) + LO
    if HAS_CU:
        st = tl.load(start_ptr + q, mask=q_ok, other=0).to(q.dtype)
        lo = tl.where(st > 0, st, lo)  # later documents never see the prefix
    return lo


@triton.jit
def _load_src(x_ptr, p_ptr, xrow, prow, src, vis, offs_d, d_ok, D, W: tl.constexpr,
              HAS_PREFIX: tl.constexpr):
    """x at positions src (a [BT] vector) as fp32 [BT, BD]; 0 where not visible, prefix where < 0."""
    m = (vis & (src >= 0))[:, None] & d_ok[None, :]
    v = tl.load(x_ptr + xrow + src[:, None] * D + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_PREFIX:
        m = (vis & (src < 0))[:, None] & d_ok[None, :]
        v += tl.load(p_ptr + prow + (src + W - 1)[:, None] * D + offs_d[None, :], mask=m,
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, i: tl.constexpr, offs_d, d_ok, D, W: tl.constexpr,
         HAS_PREFIX: tl.constexpr):
    """The x that tap i reads for tokens q (x[q - (W-1-i)]) as fp32 [BT, BD]; 0 where not visible."""
    src = q - (W - 1 - i)
    return _load_src(x_ptr, p_ptr, xrow, prow, src, q_ok & (src >= lo), offs_d, d_ok, D, W, HAS_PREFIX)


@triton.jit
def _weight(w_ptr, offs_d, d_ok, i: tl.constexpr, W: tl.constexpr):
    """w[:, i] as fp32 [1, BD] (0 for a tap i >= W, so that the W <= 4 path may name four taps)."""
    return tl.load(w_ptr + offs_d * W + i, mask=d_ok & (i < W), other=0.0).to(tl.float32)[None, :]


@triton.jit
def _four_weights(w_ptr, offs_d, d_ok, W: tl.constexpr):
    """Columns 0..3 of w as fp32 [1, BD] each (0 past W): the W <= 4 kernels load them once per program."""
    return (_weight(w_ptr, offs_d, d_ok, 0, W), _weight(w_ptr, offs_d, d_ok, 1, W),
            _weight(w_ptr, offs_d, d_ok, 2, W), _weight(w_ptr, offs_d, d_ok, 3, W))


@triton.jit
def _pick(w0, w1, w2, w3, i: tl.constexpr):
    """The weight column of tap i (< 4) among the four loaded ones."""
    w = w0
    if i == 1:
        w = w1
    if i == 2:
        w = w2
    if i == 3:
        w = w3
    return w


@triton.jit
def _preact(x_ptr, w_ptr, b_ptr, p_ptr, xrow, prow, q, q_ok, lo, offs_d, d_ok, D,
            W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """z at tokens q: fp32 [BT, BD]."""
    z = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(W):
        z += _weight(w_ptr, offs_d, d_ok, i, W) * _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, i, offs_d, d_ok,
                                                       D, W, HAS_PREFIX)
    return z


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, b_ptr, p_ptr, start_ptr, y_ptr, T, D,
                     W: tl.constexpr, LO: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CU: tl.constexpr,
                     HAS_PREFIX: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, TILES: tl.constexpr):
    """TILES tiles of BLOCK_T tokens. For W <= 4 the weights and bias are loaded once per program and
    z summed as _preact sums it (bias, then taps 0..W-1), so pass 1's recomputed z rounds alike."""
    b = tl.program_id(2).to(tl.int64)
    xrow, prow = b * T * D, b * (W - 1) * D  # int64: B*T*D may exceed 2^31
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if W <= 4:
        w0, w1, w2, w3 = _four_weights(w_ptr, offs_d, d_ok, W)
        bias = tl.zeros((1, BLOCK_D), dtype=tl.float32)
        if HAS_BIAS:
            bias += tl.load(b_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for tile in tl.static_range(TILES):
        q = (tl.program_id(0).to(tl.int64) * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        q_ok = q < T
        lo = _lowest_visible(start_ptr, q, q_ok, HAS_CU, LO)
        if W <= 4:
            z = bias + w0 * _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, 0, offs_d, d_ok, D, W, HAS_PREFIX)
            for i in tl.static_range(1, W):
                z += _pick(w0, w1, w2, w3, i) * _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, i, offs_d, d_ok,
                                                     D, W, HAS_PREFIX)
        else:
            z = _preact(x_ptr, w_ptr, b_ptr, p_ptr, xrow, prow, q, q_ok, lo, offs_d, d_ok, D,
                        W, HAS_BIAS, HAS_PREFIX, BLOCK_T, BLOCK_D)
        if SILU:
            z = z * tl.sigmoid(z)
        tl.store(y_ptr + xrow + q[:, None] * D + offs_d[None, :], z.to(y_ptr.dtype.element_ty),
                 mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv_dz_kernel(x_ptr, w_ptr, b_ptr, p_ptr, start_ptr, dy_ptr, dz_ptr, dw_ptr, db_ptr, T, D,
                    W: tl.constexpr, W_POW2: tl.constexpr, LO: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_CU: tl.constexpr, HAS_PREFIX: tl.constexpr, SILU: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr):
    """Pass 1 over a chunk of tokens: dz = dy * act'(z) (stored for pass 2 when there is an
    activation; without one dz is dy) and the chunk's partial sums of dw and dbias. Those are
    accumulated element by element and reduced over tokens once, at the end: a reduction across
    the tile's threads per tile cost more than all of the loads.

    W <= 4 (the model's width): each tap's shifted x tile is loaded once and used for z and for dw,
    which has one accumulator tile per tap (dw0..dw3, picked at compile time: `i`, `W` are constexpr).
    Wider kernels take the generic path: one [W_POW2, BT, BD] accumulator updated through a select
    per tap (W_POW2 times the arithmetic), and x loaded a second time for dw."""
    pid_c = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    xrow, prow = b * T * D, b * (W - 1) * D  # int64: B*T*D may exceed 2^31
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    db = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # Terms of dw[:, i]: in dw_i for W <= 4, in dw[i] for wider kernels. The accumulators the width
    # does not use are never updated nor stored, and the compiler drops them.
    dw0 = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    dw1 = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    taps = tl.arange(0, W_POW2)
    dw = tl.zeros((W_POW2, BLOCK_T, BLOCK_D), dtype=tl.float32)
    if W <= 4:  # the weights and the bias, loaded once per program rather than per tile
        w0, w1, w2, w3 = _four_weights(w_ptr, offs_d, d_ok, W)
        bias = tl.zeros((1, BLOCK_D), dtype=tl.float32)
        if HAS_BIAS:
            bias += tl.load(b_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for k in range(0, CHUNK_T, BLOCK_T):
        t0 = pid_c.to(tl.int64) * CHUNK_T + k
        if t0 < T:  # the last chunk may be short (a static trip count keeps the interpreter happy)
            q = t0 + tl.arange(0, BLOCK_T)
            q_ok = q < T
            lo = _lowest_visible(start_ptr, q, q_ok, HAS_CU, LO)
            offs = xrow + q[:, None] * D + offs_d[None, :]
            m = q_ok[:, None] & d_ok[None, :]
            dz = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
            if W <= 4:
                # Each shifted x tile is loaded once, for z and for dw. z is summed in _preact's order
                # (bias, then taps 0..W-1), so dz rounds as the forward's z did; unused without SILU.
                x0 = _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, 0, offs_d, d_ok, D, W, HAS_PREFIX)
                z = bias + w0 * x0
                if W > 1:
                    x1 = _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, 1, offs_d, d_ok, D, W, HAS_PREFIX)
                    z += w1 * x1
                if W > 2:
                    x2 = _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, 2, offs_d, d_ok, D, W, HAS_PREFIX)
                    z += w2 * x2
                if W > 3:
                    x3 = _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, 3, offs_d, d_ok, D, W, HAS_PREFIX)
                    z += w3 * x3
            elif SILU:
                z = _preact(x_ptr, w_ptr, b_ptr, p_ptr, xrow, prow, q, q_ok, lo, offs_d, d_ok, D,
                            W, HAS_BIAS, HAS_PREFIX, BLOCK_T, BLOCK_D)
            if SILU:  # recompute z instead of saving it: silu'(z) = sig(z) * (1 + z * (1 - sig(z)))
                sig = tl.sigmoid(z)
                dz = dz * sig * (1.0 + z * (1.0 - sig))
                tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=m)
            db += dz
            if W <= 4:
                dw0 += dz * x0
                if W > 1:
                    dw1 += dz * x1
                if W > 2:
                    dw2 += dz * x2
                if W > 3:
                    dw3 += dz * x3
            else:
                for i in tl.static_range(W):
                    xv = _tap(x_ptr, p_ptr, xrow, prow, q, q_ok, lo, i, offs_d, d_ok, D, W, HAS_PREFIX)
                    dw += tl.where(taps[:, None, None] == i, (dz * xv)[None, :, :], 0.0)

    # One [D, W] block of partial sums per (batch, chunk), in the weight's own layout: their sum over
    # blocks is the weight's gradient as it is, with no transpose and copy after it.
    part = b * tl.num_programs(0) + pid_c
    if W <= 4:
        dw_row = dw_ptr + part * D * W + offs_d * W  # dw[part, d, i] is dw_row + i
        tl.store(dw_row, tl.sum(dw0, axis=0), mask=d_ok)
        if W > 1:
            tl.store(dw_row + 1, tl.sum(dw1, axis=0), mask=d_ok)
        if W > 2:
            tl.store(dw_row + 2, tl.sum(dw2, axis=0), mask=d_ok)
        if W > 3:
            tl.store(dw_row + 3, tl.sum(dw3, axis=0), mask=d_ok)
    else:
        tl.store(dw_ptr + part * D * W + offs_d[None, :] * W + taps[:, None], tl.sum(dw, axis=1),
                 mask=(taps < W)[:, None] & d_ok[None, :])
    tl.store(db_ptr + part * D + offs_d, tl.sum(db, axis=0), mask=d_ok)


@triton.jit
def _dsource(dz_ptr, w_ptr, start_ptr, xrow, u, offs_d, d_ok, T, D, W: tl.constexpr, LO: tl.constexpr,
             HAS_CU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx at source positions u (u < 0: the prefix): the conv run in reverse over dz, each of the W
    tokens u..u+W-1 counted where it sees u."""
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for s in tl.static_range(W):
        acc += _weight(w_ptr, offs_d, d_ok, W - 1 - s, W) * _dz_seeing(dz_ptr, start_ptr, xrow, u, s, offs_d,
                                                                      d_ok, T, D, LO, HAS_CU)
    return acc


@triton.jit
def _dz_seeing(dz_ptr, start_ptr, xrow, u, s: tl.constexpr, offs_d, d_ok, T, D, LO: tl.constexpr,
               HAS_CU: tl.constexpr):
    """dz of tokens u + s as fp32 [BT, BD], 0 where token u + s does not see source u."""
    q = u + s
    q_ok = (q >= 0) & (q < T)
    lo = _lowest_visible(start_ptr, q, q_ok, HAS_CU, LO)
    return tl.load(dz_ptr + xrow + q[:, None] * D + offs_d[None, :],
                   mask=(q_ok & (u >= lo))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_dx_kernel(dz_ptr, w_ptr, start_ptr, dx_ptr, dp_ptr, T, D, W: tl.constexpr, P_POW2: tl.constexpr,
                    LO: tl.constexpr, HAS_CU: tl.constexpr, HAS_PREFIX: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr):
    """Pass 2: dx of TILES tiles of BLOCK_T tokens (for W <= 4 with the weights loaded once per
    program), and the prefix's gradient (the program of the first tile owns it)."""
    b = tl.program_id(2).to(tl.int64)
    xrow, prow = b * T * D, b * (W - 1) * D
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if W <= 4:
        w0, w1, w2, w3 = _four_weights(w_ptr, offs_d, d_ok, W)
    for tile in tl.static_range(TILES):
        u = (tl.program_id(0).to(tl.int64) * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        if W <= 4:  # the sum in _dsource's order: taps W-1 down to 0
            dxv = _pick(w0, w1, w2, w3, W - 1) * _dz_seeing(dz_ptr, start_ptr, xrow, u, 0, offs_d, d_ok,
                                                            T, D, LO, HAS_CU)
            for s in tl.static_range(1, W):
                dxv += _pick(w0, w1, w2, w3, W - 1 - s) * _dz_seeing(dz_ptr, start_ptr, xrow, u, s, offs_d,
                                                                     d_ok, T, D, LO, HAS_CU)
        else:
            dxv = _dsource(dz_ptr, w_ptr, start_ptr, xrow, u, offs_d, d_ok, T, D, W, LO, HAS_CU, BLOCK_T,
                           BLOCK_D)
        tl.store(dx_ptr + xrow + u[:, None] * D + offs_d[None, :], dxv.to(dx_ptr.dtype.element_ty),
                 mask=(u < T)[:, None] & d_ok[None, :])
    if HAS_PREFIX:  # noqa: SIM102  (a constexpr test, kept apart from the runtime one)
        if tl.program_id(0) == 0:  # only the first W-1 tokens read the prefix
            before = tl.arange(0, P_POW2).to(tl.int64) - (W - 1)  # positions -(W-1)..-1 (and padding)
            dpv = _dsource(dz_ptr, w_ptr, start_ptr, xrow, before, offs_d, d_ok, T, D, W, LO, HAS_CU, P_POW2,
                           BLOCK_D)
            tl.store(dp_ptr + prow + (before + W - 1)[:, None] * D + offs_d[None, :],
                     dpv.to(dp_ptr.dtype.element_ty), mask=(before < 0)[:, None] & d_ok[None, :])


def _meta(weight, bias, prefix, start, silu):
    W = weight.shape[1]
    has_prefix = prefix is not None and W > 1
    return {"W": W, "LO": -(W - 1) if has_prefix else 0, "HAS_BIAS": bias is not None,
            "HAS_CU": start is not None, "HAS_PREFIX": has_prefix, "SILU": silu, "BLOCK_D": BLOCK_D}


def _or_dummy(t, x):
    # Absent bias/prefix/start: x stands in as a pointer the kernel never reads (constexpr flags).
    return x if t is None else t


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, prefix, start, silu):
        x, weight = x.contiguous(), weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        prefix = prefix.contiguous() if prefix is not None else None
        B, T, D = x.shape
        y = torch.empty_like(x)
        if y.numel():
            meta = _meta(weight, bias, prefix, start, silu)
            grid = (triton.cdiv(T, BLOCK_T * TILES_PER_PROGRAM), triton.cdiv(D, BLOCK_D), B)
            with on_tensors_device(x):
                _conv_fwd_kernel[grid](x, weight, _or_dummy(bias, x), _or_dummy(prefix, x),
                                       _or_dummy(start, x), y, T, D, BLOCK_T=BLOCK_T, TILES=TILES_PER_PROGRAM,
                                       **meta)
        ctx.save_for_backward(x, weight, bias, prefix, start)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, prefix, start = ctx.saved_tensors
        dy = dy.contiguous()
        B, T, D = x.shape
        W = weight.shape[1]
        n_chunks = triton.cdiv(T, CHUNK_T)
        # a chunk is a whole number of tiles: overlapping tiles would count dw twice
        assert CHUNK_T % min(DZ_BLOCK_T, CHUNK_T) == 0, (CHUNK_T, DZ_BLOCK_T)
        dx = torch.empty_like(x)
        # dz in dy's dtype: it rounds like dy did (dw and dbias use it unrounded, in registers)
        dz = torch.empty_like(dy) if ctx.silu else dy
        dw = torch.empty(B * n_chunks, D, W, device=x.device, dtype=torch.float32)
        db = torch.empty(B * n_chunks, D, device=x.device, dtype=torch.float32)
        # The kernel writes dprefix only when the prefix is read at all (T > 0, W > 1).
        dp = None if prefix is None else (torch.empty_like if T and W > 1 else torch.zeros_like)(prefix)
        if x.numel():
            meta = _meta(weight, bias, prefix, start, ctx.silu)
            with on_tensors_device(x):
                _conv_dz_kernel[(n_chunks, triton.cdiv(D, BLOCK_D), B)](
                    x, weight, _or_dummy(bias, x), _or_dummy(prefix, x), _or_dummy(start, x), dy, dz, dw, db,
                    T, D, W_POW2=triton.next_power_of_2(W), BLOCK_T=min(DZ_BLOCK_T, CHUNK_T), CHUNK_T=CHUNK_T,
                    num_warps=DZ_WARPS, **meta)
                _conv_dx_kernel[(triton.cdiv(T, BLOCK_T * TILES_PER_PROGRAM), triton.cdiv(D, BLOCK_D), B)](
                    dz, weight, _or_dummy(start, x), dx, _or_dummy(dp, x), T, D, W=W,
                    P_POW2=triton.next_power_of_2(max(W - 1, 1)), LO=meta["LO"], HAS_CU=meta["HAS_CU"],
                    HAS_PREFIX=meta["HAS_PREFIX"], BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, TILES=TILES_PER_PROGRAM)
        dweight = dw.sum(0).to(weight.dtype)  # [D, W]; an fp32 master weight's gradient needs no cast
        dbias = None if bias is None else db.sum(0).to(bias.dtype)
        return dx, dweight, dbias, dp, None, None


def _document_starts(cu_seqlens: torch.Tensor, tokens: int, device) -> torch.Tensor:
    """The first row of each token's document, int32 [tokens], computed on the device (no host sync)."""
    cu = on_device(cu_seqlens, device).to(torch.int64)
    return cu[document_ids(cu, tokens)].to(torch.int32)


def triton_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None,
                         prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv + optional SiLU: x [B, T, D], weight [D, W], bias [D], prefix
    [B, W-1, D] -> y [B, T, D] in x's dtype; differentiable in x, weight, bias and prefix.

    Same semantics as `gdn_parallel.ops.short_conv.causal_conv1d` (cu_seqlens needs B = 1).
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    start = None
    if cu_seqlens is not None:  # made once per boundaries tensor: every conv of a row shares it
        start = derived(cu_seqlens, ("conv document starts", x.shape[1], x.device),
                        lambda: _document_starts(cu_seqlens, x.shape[1], x.device))
    return _CausalConv1d.apply(x, weight, bias, prefix, start, activation is not None)
