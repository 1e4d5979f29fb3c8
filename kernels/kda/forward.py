"""Forward kernels of chunked Kimi Delta Attention (the math is in gdn_parallel/ops/kda/chunk.py).

Per chunk of C = 64 tokens, with G the cumulative log decay from the chunk start ([C, K]) and the
decayed products P (common.py):

1. `decayed_products` (parallel over chunks x heads x 16-token block rows, independent of the state):
   G (stored fp32), then the block row's P(Q) and P(K), each one product through a reference decay
   (common.py). Stores scale * P(Q) (input dtype) and P(K) (fp32) for the output and the backward.
   `ut_forward` (parallel over chunks x heads): A = strictLower(diag(beta) P(K)) and T = (I + A)^-1
   (blocked forward substitution), then W = T diag(beta) (K o e^G), U = T diag(beta) V and
   K o e^{G_C - G}; stores T.
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
    block_midpoint,
    factored_dot,
    load_block_beta,
    load_row,
    summed_diagonal_pair,
    unit_lower_inverse_from_blocks,
)


@triton.jit
def _a_block(pk, beta, src0, real, row0, a: tl.constexpr, b: tl.constexpr, hv, HV: tl.constexpr,
             C: tl.constexpr):
    """Block (a, b) of A = strictLower(diag(beta) P(K)), read back from the stored P(K)."""
    p_k = load_rows(pk, row0 + 16 * a, hv, HV, C, 16, 16, 16 * b).to(tl.float32)
    return p_k * load_block_beta(beta, src0 + 16 * a, real - 16 * a, hv, HV, 16)[:, None]


@triton.jit
def decayed_products(q, k, g, cum, aqk, pk, chunk_rows, scale, H: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr,
                     PREC: tl.constexpr):
    """Rows 16a.. (a = program_id 2) of a chunk's P(Q) and P(K): two [16, C] fp32 tiles, each one
    product of the block's rows with all the chunk's keys through one reference decay. The midpoint
    of the block's own decay where it factors (common.py), else the decay at the end of block a - 1
    for the blocks left of the diagonal and the exact sum on it. Stored whole (zeros above the
    diagonal): scale P(Q) to aqk (input dtype), P(K) to pk (fp32); G of the block's rows to cum."""
    tl.static_assert(C == 64, "the decayed products are written for chunks of 4 x 16 tokens")
    chunk, hv, a = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = chunk * C
    ra = 16 * a
    src0, real = chunk_tokens(chunk_rows, chunk)
    qk_head = hv // (HV // H)
    rows = tl.arange(0, C)
    g_all = load_token_rows(g, src0, real, hv, HV, K, C, BK).to(tl.float32)
    prefix = tl.sum(tl.where(rows[:, None] < ra, g_all, 0.), axis=0)      # G at the end of block a - 1
    G_all = tl.cumsum(g_all, axis=0)
    cols = tl.arange(0, BK)
    own_rows = (rows[:, None] >= ra) & (rows[:, None] < ra + 16) & (cols[None, :] < K)
    tl.store(cum + ((row0 + rows.to(tl.int64))[:, None] * HV + hv) * K + cols[None, :], G_all, mask=own_rows)
    tl.debug_barrier()  # the block's G is read back as [16, BK] rows, by other threads than wrote them
    mid, factored = block_midpoint(cum, row0 + ra, hv, HV, K, BK)
    ref = tl.where(factored, mid, prefix)
    reach = tl.where(factored, ra + 16, ra)      # keys through ref: up to the diagonal block or before it
    keys = load_token_rows(k, src0, real, qk_head, H, K, C, BK).to(tl.float32)
    keys = keys * tl.exp(tl.where(rows[:, None] < reach, ref[None, :] - G_all, float("-inf")))
    down = tl.exp(load_rows(cum, row0 + ra, hv, HV, K, 16, BK) - ref[None, :])
    q_a = load_token_rows(q, src0 + ra, real - ra, qk_head, H, K, 16, BK).to(tl.float32)
    k_a = load_token_rows(k, src0 + ra, real - ra, qk_head, H, K, 16, BK).to(tl.float32)
    p_q = factored_dot(q_a * down, tl.trans(keys), q, PREC)
    p_k = factored_dot(k_a * down, tl.trans(keys), k, PREC)
    i = tl.arange(0, 16)
    p_q = tl.where(rows[None, :] <= ra + i[:, None], p_q, 0.)
    p_k = tl.where(rows[None, :] < ra + i[:, None], p_k, 0.)
    store_rows(aqk, p_q * scale, row0 + ra, hv, HV, C, 16, C)
    store_rows(pk, p_k, row0 + ra, hv, HV, C, 16, C)
    if reach == ra:  # a block that forgets too fast: its diagonal, stored above as zeros, summed exactly
        d_q, d_k = summed_diagonal_pair(q, k, cum, src0, real, row0, a, qk_head, hv, H, HV, K, BK, KC)
        tl.debug_barrier()  # after the zeros' stores by other threads
        store_rows(aqk, d_q * scale, row0 + ra, hv, HV, C, 16, 16, ra)
        store_rows(pk, d_k, row0 + ra, hv, HV, C, 16, 16, ra)


@triton.jit
def ut_forward(k, v, beta, cum, t_inv, pk, w, u, k_to_end, chunk_rows, H: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^-1 from the stored P(K) (blocked forward substitution), then W = T diag(beta)
    (K o e^G), U = T diag(beta) V and K o e^{G_C - G}: t_inv [Tp, HV, C]; w, k_to_end [Tp, HV, K];
    u [Tp, HV, V]."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    qk_head = hv // (HV // H)
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
