"""Backward kernels of chunked Kimi Delta Attention. Forward per chunk (S: the state at its start; G the
cumulative log decay from the chunk start, [C, K]; D = Diag(e^{G_C})):

    Delta = U - W S,   O = (scale Q o e^G) S + scale P(Q) Delta,   S' = D S + (K o e^{G_C - G})^T Delta,
    W = T diag(beta) (K o e^G),   U = T diag(beta) V,   T = (I + A)^-1,   A = strictLower(diag(beta) P(K))

so, with dS' the gradient reaching the chunk's end state,

    dDelta = scale P(Q)^T dO + (K o e^{G_C - G}) dS'
    dS     = (scale Q o e^G)^T dO + D dS' - W^T dDelta                       (carried backwards)
    dW = -dDelta S^T,  dU = dDelta,  dA = -T^T dT T^T (on A's strictly lower support).

Every factor e^{...} gives the gradient dG of its exponent the product (factor's gradient o factor),
and P(X) gives dG_i += X_i o dX_i for its left factor and dG_j -= K_j o dK_j for its right one
(common.py). Since G_i = g_1 + ... + g_i inside the chunk, dg is the reverse cumulative sum of dG
over the chunk, the last step of `intra_backward`.

Kernels: `delta_grad_local` (scale P(Q)^T dO, parallel), `state_backward` (the sequential dS chain
per document; stores dS' per chunk and the full dDelta), `qkw_backward` (through O and S': partial
dq, dk, dG, and dW, dP(Q); parallel), `ut_backward` (through W and U: dv, dbeta, more of dk and dG,
and dP(K)), `intra_backward` (through the decayed products, a 16-token block row a program; finishes
dq, dk and dG), `decay_backward` (dG into dg). Products take input-dtype operands with fp32
accumulation, like the forward.
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
    summed_diagonal_column_grads,
    summed_diagonal_row_grads,
)


@triton.jit
def delta_grad_local(aqk, do, dd_local, chunk_rows, HV: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BV: tl.constexpr):
    """dd_local = (scale P(Q))^T dO, the part of dDelta that does not need the walk."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    scores_t = tl.trans(load_rows(aqk, row0, hv, HV, C, C, C))
    for col0 in tl.range(0, V, BV):
        dout = load_token_rows(do, src0, real, hv, HV, V, C, BV, col0)
        store_rows(dd_local, tl.dot(scores_t.to(dout.dtype), dout), row0, hv, HV, V, C, BV, col0)


@triton.jit
def _dstate_step(q_decayed, cum, w, k_to_end, do, dd_local, chunk_rows, dh, dd, dstate, chunk, hv, col0,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    store_state(dh, dstate, chunk * HV + hv, K, V, BK, BV, col0)
    kt = load_rows(k_to_end, row0, hv, HV, K, C, BK)
    d = load_rows(dd_local, row0, hv, HV, V, C, BV, col0).to(tl.float32) + tl.dot(kt, dstate.to(kt.dtype))
    store_rows(dd, d, row0, hv, HV, V, C, BV, col0)
    qd = load_rows(q_decayed, row0, hv, HV, K, C, BK)
    dout = load_token_rows(do, src0, real, hv, HV, V, C, BV, col0)
    ww = load_rows(w, row0, hv, HV, K, C, BK)
    chunk_decay = tl.exp(load_row(cum, row0 + C - 1, hv, HV, K, BK))
    return (dstate * chunk_decay[:, None] + tl.dot(tl.trans(qd), dout.to(qd.dtype))
            - tl.dot(tl.trans(ww), d.to(ww.dtype)))


@triton.jit
def state_backward(q_decayed, cum, w, k_to_end, do, dd_local, chunk_rows, doc_first_chunk, doc_num_chunks,
                   dfinal, dh, dd, dh0, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DH0: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """dh [chunks, HV, K, V]: dS' at each chunk's end; dd [Tp, HV, V]: the full dDelta; dh0 [N, HV, K, V].
    q_decayed [Tp, HV, K]: scale Q o e^G, kept by the forward's output_forward."""
    col_block, hv, doc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    col0 = col_block * BV
    first = tl.load(doc_first_chunk + doc)
    count = tl.load(doc_num_chunks + doc)
    if HAS_DFINAL:
        dstate = load_state(dfinal, doc * HV + hv, K, V, BK, BV, col0).to(tl.float32)
    else:
        dstate = tl.zeros([BK, BV], dtype=tl.float32)
    if INTERPRET:  # Triton's interpreter cannot take a loaded bound in range()
        chunk = first + count - 1
        while chunk >= first:
            dstate = _dstate_step(q_decayed, cum, w, k_to_end, do, dd_local, chunk_rows, dh, dd, dstate,
                                  chunk, hv, col0, HV, K, V, C, BK, BV)
            chunk -= 1
    else:
        for step in range(count):
            dstate = _dstate_step(q_decayed, cum, w, k_to_end, do, dd_local, chunk_rows, dh, dd, dstate,
                                  first + count - 1 - step, hv, col0, HV, K, V, C, BK, BV)
    if HAS_DH0:
        store_state(dh0, dstate, doc * HV + hv, K, V, BK, BV, col0)


@triton.jit
def qkw_backward(q, k, cum, h, dh, delta, dd, do, dq_part, dk_part, dcum, dw, dpq, chunk_rows, scale,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    """Through O's inter-chunk term and S': dq_part, dk_part, dcum (dG) [Tp, HV, K] fp32 (completed
    by the later kernels), dW [Tp, HV, K] and dP(Q) [Tp, HV, C] fp32 (lower, scale included)."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    qk_head = hv // (HV // H)
    do_state = tl.zeros([C, BK], dtype=tl.float32)      # dO S^T
    do_delta = tl.zeros([C, C], dtype=tl.float32)       # dO Delta^T
    delta_dh = tl.zeros([C, BK], dtype=tl.float32)      # Delta dS'^T
    dd_state = tl.zeros([C, BK], dtype=tl.float32)      # dDelta S^T
    state_dot = tl.zeros([BK], dtype=tl.float32)        # rowsum(S o dS')
    # Not software-pipelined (num_stages=1): Triton 3.6 on Hopper miscomputed the GDN kernels' loop of
    # this shape when pipelined (gated_delta_rule/backward.py, above its qkw_backward).
    for col0 in tl.range(0, V, BV, num_stages=1):
        state = load_state(h, chunk * HV + hv, K, V, BK, BV, col0)
        dstate = load_state(dh, chunk * HV + hv, K, V, BK, BV, col0)
        dl = load_rows(delta, row0, hv, HV, V, C, BV, col0)
        ddl = load_rows(dd, row0, hv, HV, V, C, BV, col0)
        dout = load_token_rows(do, src0, real, hv, HV, V, C, BV, col0)
        do_state += tl.dot(dout, tl.trans(state))
        do_delta += tl.dot(dout, tl.trans(dl))
        delta_dh += tl.dot(dl, tl.trans(dstate))
        dd_state += tl.dot(ddl, tl.trans(state))
        state_dot += tl.sum(state.to(tl.float32) * dstate.to(tl.float32), axis=1)
    qq = load_token_rows(q, src0, real, qk_head, H, K, C, BK).to(tl.float32)
    kk = load_token_rows(k, src0, real, qk_head, H, K, C, BK).to(tl.float32)
    G = load_rows(cum, row0, hv, HV, K, C, BK)
    g_last = load_row(cum, row0 + C - 1, hv, HV, K, BK)
    # O's inter-chunk term (scale Q o e^G) S.
    dq_inter = do_state * tl.exp(G) * scale
    dG = qq * dq_inter
    # S' = D S + (K o e^{G_C - G})^T Delta: the key and the exponent G_C - G, and D's e^{G_C}.
    dk_to_end = delta_dh * tl.exp(g_last[None, :] - G)
    through_end = kk * dk_to_end
    dG -= through_end
    i = tl.arange(0, C)
    last_row = tl.sum(through_end, axis=0) + tl.exp(g_last) * state_dot
    dG += tl.where((i == C - 1)[:, None], last_row[None, :], 0.)
    store_rows(dq_part, dq_inter, row0, hv, HV, K, C, BK)
    store_rows(dk_part, dk_to_end, row0, hv, HV, K, C, BK)
    store_rows(dcum, dG, row0, hv, HV, K, C, BK)
    store_rows(dw, -dd_state, row0, hv, HV, K, C, BK)
    store_rows(dpq, tl.where(i[:, None] >= i[None, :], do_delta * scale, 0.), row0, hv, HV, C, C, C)


@triton.jit
def ut_backward(k, v, beta, cum, t_inv, pk, dw, dd, dk_part, dcum, dv, dbeta, dpk, chunk_rows,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """Through W = T diag(beta) (K o e^G) and U = T diag(beta) V: writes dv and dbeta (the caller's,
    unpadded; dbeta is complete here), adds into dk_part and dcum, and writes dP(K) [Tp, HV, C] fp32
    (strictly lower)."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    b = load_block_beta(beta, src0, real, hv, HV, C)
    t_in = load_rows(t_inv, row0, hv, HV, C, C, C).to(k.dtype.element_ty)
    kk = load_token_rows(k, src0, real, hv // (HV // H), H, K, C, BK).to(tl.float32)
    e_G = tl.exp(load_rows(cum, row0, hv, HV, K, C, BK))
    key_decayed = kk * e_G
    dww = load_rows(dw, row0, hv, HV, K, C, BK).to(k.dtype.element_ty)
    d_t = tl.dot(dww, tl.trans((key_decayed * b[:, None]).to(k.dtype.element_ty)))
    d_key_scaled = tl.dot(tl.trans(t_in), dww)                  # d(diag(beta) (K o e^G))
    db = tl.sum(d_key_scaled * key_decayed, axis=1)
    d_key_decayed = d_key_scaled * b[:, None]
    store_rows(dk_part, load_rows(dk_part, row0, hv, HV, K, C, BK) + d_key_decayed * e_G, row0, hv, HV, K, C,
               BK)
    store_rows(dcum, load_rows(dcum, row0, hv, HV, K, C, BK) + d_key_decayed * key_decayed, row0, hv, HV, K,
               C, BK)
    for col0 in tl.range(0, V, BV):
        du = load_rows(dd, row0, hv, HV, V, C, BV, col0).to(t_in.dtype)
        vv = load_token_rows(v, src0, real, hv, HV, V, C, BV, col0)
        d_v_scaled = tl.dot(tl.trans(t_in), du)
        store_token_rows(dv, d_v_scaled * b[:, None], src0, real, hv, HV, V, C, BV, col0)
        db += tl.sum(vv.to(tl.float32) * d_v_scaled, axis=1)
        d_t += tl.dot(du, tl.trans((vv * b[:, None]).to(vv.dtype)))
    # T = (I + A)^-1  =>  dA = -T^T dT T^T, kept on A's strictly lower support.
    d_a = -tl.dot(tl.dot(tl.trans(t_in), d_t.to(t_in.dtype)).to(t_in.dtype), tl.trans(t_in))
    i = tl.arange(0, C)
    d_a = tl.where(i[:, None] > i[None, :], d_a, 0.)
    db += tl.sum(d_a * load_rows(pk, row0, hv, HV, C, C, C).to(tl.float32), axis=1)
    store_rows(dpk, d_a * b[:, None], row0, hv, HV, C, C, C)
    tl.store(dbeta + (src0 + i) * HV + hv, db.to(dbeta.dtype.element_ty), mask=i < real)


@triton.jit
def intra_backward(q, k, cum, dpq, dpk, dq_part, dk_part, dcum, dq, dk, chunk_rows, H: tl.constexpr,
                   HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, JG: tl.constexpr,
                   PREC: tl.constexpr):
    """Through the decayed products P(Q) and P(K), rows 16r.. (r = program_id 2) of a chunk: finishes
    dq and dk there (the caller's rows, per value head: [tokens, HV, K]) and dG (dcum). Each side of
    the products is one product of the block's rows or columns of dP with the whole chunk's rows,
    through a reference decay (common.py): the midpoint of block r's decay where it factors; else the
    decay at the end of block r - 1 for the keys before it and at the end of block r for the rows
    after it, and the exact sums on the diagonal block."""
    chunk, hv, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = chunk * C
    rr = 16 * r
    src0, real = chunk_tokens(chunk_rows, chunk)
    qk_head = hv // (HV // H)
    rows = tl.arange(0, C)
    G_all = load_rows(cum, row0, hv, HV, K, C, BK)
    g_r = load_rows(cum, row0 + rr, hv, HV, K, 16, BK)
    mid, factored = block_midpoint(cum, row0 + rr, hv, HV, K, BK)
    # dX_i = sum_{j <= i} dP_ij K_j e^{G_i - G_j}: the block's rows of dP against the keys up to it
    before_end = tl.sum(tl.where(rows[:, None] == rr - 1, G_all, 0.), axis=0)    # 0 for r = 0: unused
    ref = tl.where(factored, mid, before_end)
    reach = tl.where(factored, rr + 16, rr)
    k_all = load_token_rows(k, src0, real, qk_head, H, K, C, BK).to(tl.float32)
    keys = k_all * tl.exp(tl.where(rows[:, None] < reach, ref[None, :] - G_all, float("-inf")))
    down = tl.exp(g_r - ref[None, :])
    dq_left = factored_dot(load_rows(dpq, row0 + rr, hv, HV, C, 16, C), keys, k, PREC) * down
    dk_left = factored_dot(load_rows(dpk, row0 + rr, hv, HV, C, 16, C), keys, k, PREC) * down
    # dK_j = sum_{i >= j} dP_ij X_i e^{G_i - G_j}: the block's columns of dP against the rows from it
    block_end = tl.sum(tl.where(rows[:, None] == rr + 15, G_all, 0.), axis=0)
    ref = tl.where(factored, mid, block_end)
    start = tl.where(factored, rr, rr + 16)
    from_ref = tl.exp(tl.where(rows[:, None] >= start, G_all - ref[None, :], float("-inf")))
    up = tl.exp(ref[None, :] - g_r)
    q_all = load_token_rows(q, src0, real, qk_head, H, K, C, BK).to(tl.float32)
    dp_q_t = tl.trans(load_rows(dpq, row0, hv, HV, C, C, 16, rr))
    dp_k_t = tl.trans(load_rows(dpk, row0, hv, HV, C, C, 16, rr))
    dk_of_q = factored_dot(dp_q_t, q_all * from_ref, q, PREC) * up
    dk_right = factored_dot(dp_k_t, k_all * from_ref, k, PREC) * up
    if reach == rr:  # a block that forgets too fast: its diagonal block, summed exactly
        diag_q, diag_k = summed_diagonal_row_grads(dpq, dpk, k, cum, src0, real, row0, rr, qk_head, hv, H, HV,
                                                   K, C, BK, JG)
        dq_left += diag_q
        dk_left += diag_k
        diag_q, diag_k = summed_diagonal_column_grads(dpq, dpk, q, k, cum, src0, real, row0, rr, qk_head, hv,
                                                      H, HV, K, C, BK, JG)
        dk_of_q += diag_q
        dk_right += diag_k
    src, left = src0 + rr, real - rr
    q_r = load_token_rows(q, src, left, qk_head, H, K, 16, BK).to(tl.float32)
    k_r = load_token_rows(k, src, left, qk_head, H, K, 16, BK).to(tl.float32)
    rows_r = row0 + rr
    store_token_rows(dq, load_rows(dq_part, rows_r, hv, HV, K, 16, BK) + dq_left, src, left, hv, HV, K, 16,
                     BK)
    store_token_rows(dk, load_rows(dk_part, rows_r, hv, HV, K, 16, BK) + dk_of_q + dk_left + dk_right, src,
                     left, hv, HV, K, 16, BK)
    dG_r = load_rows(dcum, rows_r, hv, HV, K, 16, BK) + q_r * dq_left + k_r * (dk_left - dk_of_q - dk_right)
    store_rows(dcum, dG_r, rows_r, hv, HV, K, 16, BK)


@triton.jit
def decay_backward(dcum, dg, chunk_rows, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr):
    """dg (the caller's, unpadded) as the reverse cumulative sum of dG over each chunk, since
    G_i = g_1 + ... + g_i inside it."""
    chunk, hv = tl.program_id(0), tl.program_id(1)
    src0, real = chunk_tokens(chunk_rows, chunk)
    dG = load_rows(dcum, chunk * C, hv, HV, K, C, BK)
    store_token_rows(dg, tl.cumsum(dG, axis=0, reverse=True), src0, real, hv, HV, K, C, BK)
