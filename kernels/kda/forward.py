"""Forward kernels of chunked Kimi Delta Attention (the math is in gdn_parallel/ops/kda/chunk.py).

Per chunk of C = 64 tokens, with G the cumulative log decay from the chunk start ([C, K]) and the
decayed products P (common.py):

1. `intra_forward` (parallel over chunks x heads, independent of the state): G (stored fp32), the
   blocks of P(Q) and P(K), A = strictLower(diag(beta) P(K)) and T = (I + A)^-1 (blocked forward
   substitution), then W = T diag(beta) (K o e^G), U = T diag(beta) V and K o e^{G_C - G}.
   Stores T, scale * P(Q) (input dtype) and P(K) (fp32) for the output and the backward.
2. `state_forward` (the only sequential part; per document, head and value block): the fp32 state in
   registers, Delta = U - W S, S <- Diag(e^{G_C}) S + (K o e^{G_C - G})^T Delta. Stores the state at
   every chunk start (input dtype: read back, never carried) and Delta; the final state in fp32.
3. `output_forward` (parallel): O = (scale Q o e^G) S + scale P(Q) Delta; keeps scale Q o e^G.
"""
import triton
import triton.language as tl

from ..gated_delta_rule.common import (
    chunk_tokens,
    load_rows,
    load_state,
    load_token_rows,
    store_rows,
    store_state,
    store_token_rows,
)
from .common import (
    diagonal_block_pair,
    load_block_beta,
    load_row,
    off_diagonal_block_pair,
    unit_lower_inverse_from_blocks,
)


@triton.jit
def _a_block(pk, beta, src0, real, row0, a: tl.constexpr, b: tl.constexpr, hv, HV: tl.constexpr,
             C: tl.constexpr):
    """Block (a, b) of A = strictLower(diag(beta) P(K)), read back from the stored P(K)."""
    p_k = load_rows(pk, row0 + 16 * a, hv, HV, C, 16, 16, 16 * b).to(tl.float32)
    return p_k * load_block_beta(beta, src0 + 16 * a, real - 16 * a, hv, HV, 16)[:, None]


@triton.jit
def intra_forward(q, k, v, g, beta, cum, t_inv, aqk, pk, w, u, k_to_end, chunk_rows, scale,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr):
    """q, k [tokens, H, K], v [tokens, HV, V], g [tokens, HV, K], beta [tokens, HV]: the caller's,
    unpadded (chunk_rows). Writes cum [Tp, HV, K] fp32; t_inv, aqk, pk [Tp, HV, C]; w, k_to_end
    [Tp, HV, K]; u [Tp, HV, V]."""
    tl.static_assert(C == 64, "the decayed products are written for chunks of 4 x 16 tokens")
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    qk_head = hv // (HV // H)
    gg = load_token_rows(g, src0, real, hv, HV, K, C, BK).to(tl.float32)
    store_rows(cum, tl.cumsum(gg, axis=0), row0, hv, HV, K, C, BK)
    tl.debug_barrier()  # G is read back below in 16-token blocks, by other threads than wrote it
    # The blocks of P(Q) and P(K) in loops, each stored at once: unrolled, their loads were all hoisted
    # and spilled (ptxas, sm_90, K = 128).
    zero = tl.zeros([16, 16], dtype=tl.float32)
    for a in tl.range(0, C // 16):
        p_q, p_k = diagonal_block_pair(q, k, cum, src0, real, row0, a, qk_head, hv, H, HV, K, BK, KC)
        store_rows(aqk, p_q * scale, row0 + 16 * a, hv, HV, C, 16, 16, 16 * a)
        store_rows(pk, p_k, row0 + 16 * a, hv, HV, C, 16, 16, 16 * a)
        for b in tl.range(0, a):
            p_q, p_k = off_diagonal_block_pair(q, k, cum, src0, real, row0, a, b, qk_head, hv, H, HV, K, BK)
            store_rows(aqk, p_q * scale, row0 + 16 * a, hv, HV, C, 16, 16, 16 * b)
            store_rows(pk, p_k, row0 + 16 * a, hv, HV, C, 16, 16, 16 * b)
        for b in tl.range(a + 1, C // 16):  # the upper blocks, so that later kernels read whole tiles
            store_rows(aqk, zero, row0 + 16 * a, hv, HV, C, 16, 16, 16 * b)
            store_rows(pk, zero, row0 + 16 * a, hv, HV, C, 16, 16, 16 * b)
    tl.debug_barrier()  # P(K) is read back in blocks
    unit_lower_inverse_from_blocks(
        _a_block(pk, beta, src0, real, row0, 0, 0, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 1, 0, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 1, 1, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 2, 0, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 2, 1, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 2, 2, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 3, 0, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 3, 1, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 3, 2, hv, HV, C),
        _a_block(pk, beta, src0, real, row0, 3, 3, hv, HV, C),
        t_inv, row0, hv, HV, C, PREC)
    tl.debug_barrier()  # T is read back as one tile
    t_in = load_rows(t_inv, row0, hv, HV, C, C, C).to(k.dtype.element_ty)
    kk = load_token_rows(k, src0, real, qk_head, H, K, C, BK).to(tl.float32)
    G = load_rows(cum, row0, hv, HV, K, C, BK)
    beta_c = load_block_beta(beta, src0, real, hv, HV, C)
    key_scaled = (kk * tl.exp(G) * beta_c[:, None]).to(k.dtype.element_ty)
    store_rows(w, tl.dot(t_in, key_scaled), row0, hv, HV, K, C, BK)
    g_last = load_row(cum, row0 + C - 1, hv, HV, K, BK)
    store_rows(k_to_end, kk * tl.exp(g_last[None, :] - G), row0, hv, HV, K, C, BK)
    for col0 in tl.range(0, V, BV):
        vv = load_token_rows(v, src0, real, hv, HV, V, C, BV, col0)
        store_rows(u, tl.dot(t_in, (vv * beta_c[:, None]).to(vv.dtype)), row0, hv, HV, V, C, BV, col0)


@triton.jit
def _state_step(w, u, k_to_end, cum, h, delta, state, chunk, hv, col0, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    row0 = chunk * C
    store_state(h, state, chunk * HV + hv, K, V, BK, BV, col0)
    ww = load_rows(w, row0, hv, HV, K, C, BK)
    d = load_rows(u, row0, hv, HV, V, C, BV, col0).to(tl.float32) - tl.dot(ww, state.to(ww.dtype))
    store_rows(delta, d, row0, hv, HV, V, C, BV, col0)
    kt = load_rows(k_to_end, row0, hv, HV, K, C, BK)
    chunk_decay = tl.exp(load_row(cum, row0 + C - 1, hv, HV, K, BK))
    return state * chunk_decay[:, None] + tl.dot(tl.trans(kt), d.to(kt.dtype))


@triton.jit
def state_forward(w, u, k_to_end, cum, doc_first_chunk, doc_num_chunks, h0, h, delta, final,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_H0: tl.constexpr, HAS_FINAL: tl.constexpr, INTERPRET: tl.constexpr):
    """h [chunks, HV, K, V]: the state at each chunk's start; delta [Tp, HV, V]; final [N, HV, K, V]."""
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
            state = _state_step(w, u, k_to_end, cum, h, delta, state, chunk, hv, col0, HV, K, V, C, BK, BV)
            chunk += 1
    else:
        for chunk in range(first, first + count):
            state = _state_step(w, u, k_to_end, cum, h, delta, state, chunk, hv, col0, HV, K, V, C, BK, BV)
    if HAS_FINAL:
        store_state(final, state, doc * HV + hv, K, V, BK, BV, col0)


@triton.jit
def output_forward(q, cum, aqk, h, delta, o, q_decayed_out, chunk_rows, scale, H: tl.constexpr,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr):
    """o is the caller's, unpadded (chunk_rows): padding rows are not written. The value columns in a
    loop, so that the decayed queries are made once for all of them; they are stored too
    (q_decayed_out [Tp, HV, K]), for the backward walk, which then reads one tile instead of q and G."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    qq = load_token_rows(q, src0, real, hv // (HV // H), H, K, C, BK)
    q_decayed = (qq * tl.exp(load_rows(cum, row0, hv, HV, K, C, BK)) * scale).to(qq.dtype)
    store_rows(q_decayed_out, q_decayed, row0, hv, HV, K, C, BK)
    scores = load_rows(aqk, row0, hv, HV, C, C, C)
    for col0 in tl.range(0, V, BV):
        state = load_state(h, chunk * HV + hv, K, V, BK, BV, col0)
        d = load_rows(delta, row0, hv, HV, V, C, BV, col0)
        out = tl.dot(q_decayed, state.to(qq.dtype)) + tl.dot(scores.to(d.dtype), d)
        store_token_rows(o, out, src0, real, hv, HV, V, C, BV, col0)
