"""Forward kernels of the chunked gated delta rule (the math is in
gdn_parallel/ops/gated_delta_rule/chunk.py).

1. `ut_forward`: per chunk and head, T = (I + A)^-1 (computed once here and kept, in the input dtype,
   for the backward) and the UT transform W = T diag(beta e^gamma) K, U = T diag(beta) V.
   Independent of the state: fully parallel.
2. `state_forward`: per document, head and value block, the only sequential part. Walks the chunks
   with the state in fp32 registers: Delta = U - W S, S <- e^{gamma_C} S + (K e^{gamma_C - gamma})^T Delta.
   Stores the state at the start of every chunk (input dtype: only read back, never carried, so
   the rounding does not accumulate along the sequence) and Delta; the final state in fp32.
2b. `span_summary_forward`: the same walk over a span of chunks, started from [I | 0] with values
   [0 | U]; it ends in [M | S_loc], the span's affine map S_end = M S_start + S_loc (scan.py).
3. `output_forward`: per chunk, head and value block, O = scale (e^gamma Q S + (Q K^T o Gamma) Delta).
"""
import triton
import triton.language as tl

from .common import (
    chunk_tokens,
    decay_matrix,
    identity_columns,
    load_gamma,
    load_rows,
    load_state,
    load_token_rows,
    load_value_columns,
    store_rows,
    store_state,
    store_summary,
    store_token_rows,
    unit_lower_inverse,
)


@triton.jit
def ut_forward(k, v, beta, gamma, t_inv, w, u, chunk_rows, Tp, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               PREC: tl.constexpr, COMPUTE_T: tl.constexpr):
    """With COMPUTE_T the inverse is computed and stored in `t_inv` [Tp, HV, C], else read from it.
    v is the caller's, unpadded (chunk_rows)."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    if COMPUTE_T:
        unit_lower_inverse(k, beta, gamma, t_inv, row0, hv, Tp, H, HV, K, C, BK, PREC)
        tl.debug_barrier()  # T is read back below as one tile, by other threads than wrote each block
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    b = tl.load(beta + (row0 + tl.arange(0, C)) * HV + hv).to(tl.float32)
    gam, _ = load_gamma(gamma, row0, hv, Tp, C)
    t_in = load_rows(t_inv, row0, hv, HV, C, C, C).to(kk.dtype)
    key_scaled = (kk * (b * tl.exp(gam))[:, None]).to(kk.dtype)
    store_rows(w, tl.dot(t_in, key_scaled), row0, hv, HV, K, C, BK)
    for col0 in tl.range(0, V, BV):
        vv = load_token_rows(v, src0, real, hv, HV, V, C, BV, col0)
        store_rows(u, tl.dot(t_in, (vv * b[:, None]).to(vv.dtype)), row0, hv, HV, V, C, BV, col0)


@triton.jit
def _state_step(k, w, u, gamma, h, delta, state, chunk, hv, col0, Tp, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    row0 = chunk * C
    store_state(h, state, chunk * HV + hv, K, V, BK, BV, col0)
    ww = load_rows(w, row0, hv, HV, K, C, BK)
    d = load_rows(u, row0, hv, HV, V, C, BV, col0).to(tl.float32) - tl.dot(ww, state.to(ww.dtype))
    store_rows(delta, d, row0, hv, HV, V, C, BV, col0)
    gam, g_last = load_gamma(gamma, row0, hv, Tp, C)
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    k_to_end = (kk * tl.exp(g_last - gam)[:, None]).to(kk.dtype)
    return state * tl.exp(g_last) + tl.dot(tl.trans(k_to_end), d.to(kk.dtype))


@triton.jit
def state_forward(k, w, u, gamma, doc_first_chunk, doc_num_chunks, h0, h, delta, final, Tp,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, HAS_FINAL: tl.constexpr,
                  INTERPRET: tl.constexpr):
    col_block, hv, doc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    col0 = col_block * BV
    first = tl.load(doc_first_chunk + doc)
    count = tl.load(doc_num_chunks + doc)
    if HAS_H0:
        state = load_state(h0, doc * HV + hv, K, V, BK, BV, col0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    if INTERPRET:  # Triton's interpreter cannot take a loaded bound in range()
        chunk = first
        while chunk < first + count:
            state = _state_step(k, w, u, gamma, h, delta, state, chunk, hv, col0, Tp, H, HV, K, V, C, BK, BV)
            chunk += 1
    else:
        for chunk in range(first, first + count):
            state = _state_step(k, w, u, gamma, h, delta, state, chunk, hv, col0, Tp, H, HV, K, V, C, BK, BV)
    if HAS_FINAL:
        store_state(final, state, doc * HV + hv, K, V, BK, BV, col0)


@triton.jit
def _summary_step(k, w, u, gamma, state, chunk, hv, cols, Tp, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    row0 = chunk * C
    ww = load_rows(w, row0, hv, HV, K, C, BK)
    d = load_value_columns(u, row0, C, hv, HV, V, K, C, cols).to(tl.float32) - tl.dot(ww, state.to(ww.dtype))
    gam, g_last = load_gamma(gamma, row0, hv, Tp, C)
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    k_to_end = (kk * tl.exp(g_last - gam)[:, None]).to(kk.dtype)
    return state * tl.exp(g_last) + tl.dot(tl.trans(k_to_end), d.to(kk.dtype))


@triton.jit
def span_summary_forward(k, w, u, gamma, span_first, span_num_chunks, summary, Tp, H: tl.constexpr,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BE: tl.constexpr, INTERPRET: tl.constexpr):
    col_block, hv, span = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = col_block * BE + tl.arange(0, BE)
    first = tl.load(span_first + span)
    count = tl.load(span_num_chunks + span)
    state = identity_columns(cols, BK, K)
    if INTERPRET:  # Triton's interpreter cannot take a loaded bound in range()
        chunk = first
        while chunk < first + count:
            state = _summary_step(k, w, u, gamma, state, chunk, hv, cols, Tp, H, HV, K, V, C, BK)
            chunk += 1
    else:
        for chunk in range(first, first + count):
            state = _summary_step(k, w, u, gamma, state, chunk, hv, cols, Tp, H, HV, K, V, C, BK)
    store_summary(summary, state, span, hv, HV, K, V, BK, cols)


@triton.jit
def output_forward(q, k, h, delta, gamma, o, chunk_rows, scale, Tp, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """o is the caller's, unpadded (chunk_rows): padding rows are not written. One program per chunk and
    head, the value columns in a loop: Q K^T is made once for all of them."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    qq = load_rows(q, row0, hv // (HV // H), H, K, C, BK)
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    gam, _ = load_gamma(gamma, row0, hv, Tp, C)
    qk = (tl.dot(qq, tl.trans(kk)) * decay_matrix(gam, C, False) * scale).to(qq.dtype)
    q_decayed = (qq * (tl.exp(gam) * scale)[:, None]).to(qq.dtype)
    src0, real = chunk_tokens(chunk_rows, chunk)
    for col0 in tl.range(0, V, BV):
        state = load_state(h, chunk * HV + hv, K, V, BK, BV, col0)
        d = load_rows(delta, row0, hv, HV, V, C, BV, col0)
        out = tl.dot(q_decayed, state.to(qq.dtype)) + tl.dot(qk.to(d.dtype), d)
        store_token_rows(o, out, src0, real, hv, HV, V, C, BV, col0)
