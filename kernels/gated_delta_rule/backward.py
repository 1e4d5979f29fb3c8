"""Backward kernels of the chunked gated delta rule. Forward per chunk (S: state at its start):

    Delta = U - W S,   O = scale (e^gamma Q S + (Q K^T o Gamma) Delta),
    S' = e^{gamma_C} S + (K o e^{gamma_C - gamma})^T Delta,   W = T diag(beta e^gamma) K,  U = T diag(beta) V

so, with dS' the gradient reaching the chunk's end state,

    dDelta = scale (Q K^T o Gamma)^T dO + (K o e^{gamma_C - gamma}) dS'
    dS     = scale (e^gamma Q)^T dO + e^{gamma_C} dS' - W^T dDelta          (carried backwards)
    dW = -dDelta S^T,  dU = dDelta,  and the UT transform's own backward (dT -> dA = -T^T dT T^T).

Kernels: `delta_grad_local` (first term of dDelta, parallel), `state_backward` (the sequential
dS chain per document; stores dS' per chunk and the full dDelta), `span_summary_backward` (the
chain over a span from [I | 0] at its end with injections [0 | dO, dDelta_local]: ends in
[M^T | R], dS_start = M^T dS_end + R, so spans run side by side as in the forward), `qkw_backward`
(dq, dk, dW and the gate terms from O and S', parallel) and `ut_backward` (dk, dv, dbeta and gate
terms through W and U, parallel). Matrix products take input-dtype operands with fp32 accumulation,
like the forward. Gate gradients are w.r.t. gamma (head-major); the wrapper turns them into dg.
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
)


@triton.jit
def delta_grad_local(q, k, gamma, do, dd_local, chunk_rows, scale, Tp, H: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    qq = load_rows(q, row0, hv // (HV // H), H, K, C, BK)
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    gam, _ = load_gamma(gamma, row0, hv, Tp, C)
    qk_t = tl.trans(tl.dot(qq, tl.trans(kk)) * decay_matrix(gam, C, False) * scale).to(qq.dtype)
    for col0 in tl.range(0, V, BV):  # Q K^T made once for every value block
        dout = load_token_rows(do, src0, real, hv, HV, V, C, BV, col0)
        store_rows(dd_local, tl.dot(qk_t.to(dout.dtype), dout), row0, hv, HV, V, C, BV, col0)


@triton.jit
def _dstate_step(q, k, w, gamma, do, dd_local, chunk_rows, dh, dd, dstate, chunk, hv, col0, scale, Tp,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    store_state(dh, dstate, chunk * HV + hv, K, V, BK, BV, col0)
    gam, g_last = load_gamma(gamma, row0, hv, Tp, C)
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    k_to_end = (kk * tl.exp(g_last - gam)[:, None]).to(kk.dtype)
    d = (load_rows(dd_local, row0, hv, HV, V, C, BV, col0).to(tl.float32)
         + tl.dot(k_to_end, dstate.to(kk.dtype)))
    store_rows(dd, d, row0, hv, HV, V, C, BV, col0)
    qq = load_rows(q, row0, hv // (HV // H), H, K, C, BK)
    q_decayed = (qq * (tl.exp(gam) * scale)[:, None]).to(qq.dtype)
    dout = load_token_rows(do, src0, real, hv, HV, V, C, BV, col0)
    ww = load_rows(w, row0, hv, HV, K, C, BK)
    return dstate * tl.exp(g_last) + tl.dot(tl.trans(q_decayed), dout) - tl.dot(tl.trans(ww), d.to(ww.dtype))


@triton.jit
def state_backward(q, k, w, gamma, do, dd_local, chunk_rows, doc_first_chunk, doc_num_chunks, dfinal, dh, dd,
                   dh0, scale, Tp, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DFINAL: tl.constexpr,
                   HAS_DH0: tl.constexpr, INTERPRET: tl.constexpr):
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
            dstate = _dstate_step(q, k, w, gamma, do, dd_local, chunk_rows, dh, dd, dstate, chunk, hv, col0,
                                  scale, Tp, H, HV, K, V, C, BK, BV)
            chunk -= 1
    else:
        for step in range(count):
            dstate = _dstate_step(q, k, w, gamma, do, dd_local, chunk_rows, dh, dd, dstate,
                                  first + count - 1 - step, hv, col0, scale, Tp, H, HV, K, V, C, BK, BV)
    if HAS_DH0:
        store_state(dh0, dstate, doc * HV + hv, K, V, BK, BV, col0)


# Value-column loops. Unrolled (`tl.static_range`), qkw_backward took 1.025 ms at gdn-1.3b's layer on an
# H100 (16K tokens, 8 heads, K = 128, V = 256, bf16); as a loop, 0.535 ms. Not software-pipelined
# (num_stages=1): pipelined it took 0.475 ms, but Triton 3.6 on Hopper then computed dW wrong at K = 64,
# V = 128 in bf16 and fp16 (dk, dbeta and dg off by 3e-2 through ut_backward; fp32 and the other head
# sizes right; disallow_acc_multi_buffer did not mend it). ut_backward stays unrolled: as a loop it
# gained 0.02 ms.
@triton.jit
def qkw_backward(q, k, h, dh, delta, dd, do, gamma, dq, dk, dw, dgamma, chunk_rows, scale, Tp,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr):
    """Key columns in NUM_KB = BK // KB tiles of KB: one tile where the device holds all of K (the
    fast path), two where it cannot (fp32 inputs at K = 256); the C x C products sum over every tile."""
    NUM_KB: tl.constexpr = BK // KB
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    qh = hv // (HV // H)
    gam, g_last = load_gamma(gamma, row0, hv, Tp, C)
    do_delta = tl.zeros([C, C], dtype=tl.float32)       # dO Delta^T
    state_dot = tl.zeros([KB], dtype=tl.float32)        # <S, dS'> (row partial sums)
    to_end_sum = tl.zeros([C], dtype=tl.float32)
    for kb in tl.static_range(NUM_KB):
        key0 = kb * KB
        do_state = tl.zeros([C, KB], dtype=tl.float32)      # dO S^T
        delta_dh = tl.zeros([C, KB], dtype=tl.float32)      # Delta dS'^T
        dd_state = tl.zeros([C, KB], dtype=tl.float32)      # dDelta S^T
        for col0 in tl.range(0, V, BV, num_stages=1):  # see above: not pipelined
            state = load_state(h, chunk * HV + hv, K, V, KB, BV, col0, key0)
            dstate = load_state(dh, chunk * HV + hv, K, V, KB, BV, col0, key0)
            dl = load_rows(delta, row0, hv, HV, V, C, BV, col0)
            ddl = load_rows(dd, row0, hv, HV, V, C, BV, col0)
            dout = load_token_rows(do, src0, real, hv, HV, V, C, BV, col0)
            do_state += tl.dot(dout, tl.trans(state))
            if kb == 0:
                do_delta += tl.dot(dout, tl.trans(dl))
            delta_dh += tl.dot(dl, tl.trans(dstate))
            dd_state += tl.dot(ddl, tl.trans(state))
            state_dot += tl.sum(state.to(tl.float32) * dstate.to(tl.float32), axis=1)
        qq = load_rows(q, row0, qh, H, K, C, KB, key0)
        kk = load_rows(k, row0, qh, H, K, C, KB, key0)
        if kb == 0:
            # O's intra-chunk term (scale Q K^T o Gamma) Delta: its score gradient needs Q K^T over all K.
            qk = tl.dot(qq, tl.trans(kk))
            for other in tl.static_range(1, NUM_KB):
                qk += tl.dot(load_rows(q, row0, qh, H, K, C, KB, other * KB),
                             tl.trans(load_rows(k, row0, qh, H, K, C, KB, other * KB)))
            d_scores = do_delta * decay_matrix(gam, C, False) * scale
            d_gate = d_scores * qk
            dgam = tl.sum(d_gate, axis=1) - tl.sum(d_gate, axis=0)
        # O's inter-chunk term scale e^gamma Q S.
        dqq = do_state * (tl.exp(gam) * scale)[:, None]
        dgam += tl.sum(qq.to(tl.float32) * dqq, axis=1)
        dqq += tl.dot(d_scores.to(kk.dtype), kk)
        dkk = tl.dot(tl.trans(d_scores).to(qq.dtype), qq)
        # S' = e^{gamma_C} S + (K e^{gamma_C - gamma})^T Delta.
        dk_end = delta_dh * tl.exp(g_last - gam)[:, None]
        dkk += dk_end
        to_end = tl.sum(kk.to(tl.float32) * dk_end, axis=1)
        dgam -= to_end
        to_end_sum += to_end
        store_rows(dq, dqq, row0, hv, HV, K, C, KB, key0)
        store_rows(dk, dkk, row0, hv, HV, K, C, KB, key0)
        store_rows(dw, -dd_state, row0, hv, HV, K, C, KB, key0)
    last = tl.arange(0, C) == C - 1
    dgam += tl.where(last, tl.sum(to_end_sum, axis=0) + tl.exp(g_last) * tl.sum(state_dot, axis=0), 0.)
    tl.store(dgamma + hv * Tp + row0 + tl.arange(0, C), dgam)


@triton.jit
def ut_backward(k, v, beta, gamma, t_inv, dw, dd, dk, dk_out, dv, dbeta, dgamma, chunk_rows, Tp,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr):
    """Adds the gradients through W = T diag(beta e^gamma) K and U = T diag(beta) V into dgamma, and
    to dk (fp32, from qkw_backward), writing the sum to dk_out (dk itself, or the input dtype at once).
    Key columns in BK // KB tiles of KB, as in qkw_backward: the Gram matrix and dT sum over all of
    them first, then each tile gets its dk."""
    NUM_KB: tl.constexpr = BK // KB
    chunk, hv = tl.program_id(0), tl.program_id(1)
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)  # v and dv are the caller's, unpadded
    kh = hv // (HV // H)
    b = tl.load(beta + (row0 + tl.arange(0, C)) * HV + hv).to(tl.float32)
    gam, _ = load_gamma(gamma, row0, hv, Tp, C)
    e_gam = tl.exp(gam)
    t_in = load_rows(t_inv, row0, hv, HV, C, C, C).to(k.dtype.element_ty)
    gram = tl.zeros([C, C], dtype=tl.float32)
    d_t = tl.zeros([C, C], dtype=tl.float32)
    for kb in tl.static_range(NUM_KB):
        kk = load_rows(k, row0, kh, H, K, C, KB, kb * KB)
        dww = load_rows(dw, row0, hv, HV, K, C, KB, kb * KB).to(kk.dtype)
        gram += tl.dot(kk, tl.trans(kk))
        d_t += tl.dot(dww, tl.trans((kk * (b * e_gam)[:, None]).to(kk.dtype)))
    a = gram * decay_matrix(gam, C, True) * b[:, None]
    db = tl.zeros([C], dtype=tl.float32)
    for col0 in tl.static_range(0, V, BV):  # unrolled: see the note above qkw_backward
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
    decay = decay_matrix(gam, C, True)
    db += tl.sum(d_a * gram * decay, axis=1)
    d_gram = (d_a * decay * b[:, None]).to(t_in.dtype)
    d_gate = d_a * a
    dgam = tl.sum(d_gate, axis=1) - tl.sum(d_gate, axis=0)
    for kb in tl.static_range(NUM_KB):
        if NUM_KB > 1:  # one tile: kk and dW are still held from the loop above
            kk = load_rows(k, row0, kh, H, K, C, KB, kb * KB)
            dww = load_rows(dw, row0, hv, HV, K, C, KB, kb * KB).to(kk.dtype)
        dkk = tl.dot(d_gram, kk) + tl.dot(tl.trans(d_gram), kk)
        # key_scaled = diag(beta e^gamma) K
        d_key_scaled = tl.dot(tl.trans(t_in), dww)
        through_scale = tl.sum(kk.to(tl.float32) * d_key_scaled, axis=1)
        dkk += d_key_scaled * (b * e_gam)[:, None]
        db += e_gam * through_scale
        dgam += b * e_gam * through_scale
        store_rows(dk_out, load_rows(dk, row0, hv, HV, K, C, KB, kb * KB) + dkk, row0, hv, HV, K, C, KB,
                   kb * KB)
    tl.store(dbeta + (row0 + tl.arange(0, C)) * HV + hv, db)
    gptr = dgamma + hv * Tp + row0 + tl.arange(0, C)
    tl.store(gptr, tl.load(gptr) + dgam)


@triton.jit
def _summary_step(q, k, w, gamma, do, dd_local, chunk_rows, dstate, chunk, hv, cols, scale, Tp,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                  BK: tl.constexpr):
    row0 = chunk * C
    src0, real = chunk_tokens(chunk_rows, chunk)
    gam, g_last = load_gamma(gamma, row0, hv, Tp, C)
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    k_to_end = (kk * tl.exp(g_last - gam)[:, None]).to(kk.dtype)
    d = load_value_columns(dd_local, row0, C, hv, HV, V, K, C, cols).to(tl.float32) \
        + tl.dot(k_to_end, dstate.to(kk.dtype))
    qq = load_rows(q, row0, hv // (HV // H), H, K, C, BK)
    q_decayed = (qq * (tl.exp(gam) * scale)[:, None]).to(qq.dtype)
    dout = load_value_columns(do, src0, real, hv, HV, V, K, C, cols)
    ww = load_rows(w, row0, hv, HV, K, C, BK)
    return dstate * tl.exp(g_last) + tl.dot(tl.trans(q_decayed), dout) - tl.dot(tl.trans(ww), d.to(ww.dtype))


@triton.jit
def span_summary_backward(q, k, w, gamma, do, dd_local, chunk_rows, span_first, span_num_chunks, summary,
                          scale, Tp,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          C: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, INTERPRET: tl.constexpr):
    col_block, hv, span = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = col_block * BE + tl.arange(0, BE)
    first = tl.load(span_first + span)
    count = tl.load(span_num_chunks + span)
    dstate = identity_columns(cols, BK, K)
    if INTERPRET:  # Triton's interpreter cannot take a loaded bound in range()
        chunk = first + count - 1
        while chunk >= first:
            dstate = _summary_step(q, k, w, gamma, do, dd_local, chunk_rows, dstate, chunk, hv, cols, scale,
                                   Tp, H, HV, K, V, C, BK)
            chunk -= 1
    else:
        for step in range(count):
            dstate = _summary_step(q, k, w, gamma, do, dd_local, chunk_rows, dstate, first + count - 1 - step,
                                   hv, cols, scale, Tp, H, HV, K, V, C, BK)
    store_summary(summary, dstate, span, hv, HV, K, V, BK, cols)
