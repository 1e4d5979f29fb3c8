"""Pieces shared by the KDA forward and backward kernels: decayed products on 16-token blocks.

Layout as in gated_delta_rule/common.py (whose loaders these build on): buffers are token-major and
chunk-aligned, [Tp, heads, D] with every chunk inside one document; the caller's tensors stay unpadded
and are read through the chunk table (`chunk_tokens`), rows past a chunk's real tokens reading zero.
`cum` is the fp32 cumulative log decay from each chunk's start, G, [Tp, HV, K]: one value per token,
value head and key channel.

A chunk's decayed products (docs/kernels.md, "Kimi Delta Attention"):

    P(X)_ij = sum_c X_ic K_jc exp(G_ic - G_jc)        (j <= i; 0 above the diagonal)

never take exp(-G) alone, which overflows once a channel forgets (g = -5 over 64 tokens is
exp(320)). Each product factors through a reference decay ref_c between the two tokens' decays:

    exp(G_ic - G_jc) = exp(G_ic - ref_c) exp(ref_c - G_jc),

one tensor-core product of decayed rows. Left of the diagonal block of rows a, the decay at the end
of block a - 1 makes both factors <= 1 (i >= ref >= j). The diagonal block (and with it the whole
block row, in the forward) factors through the midpoint of its own decay, mid_c = (G_first,c +
G_last,c) / 2, whenever its decay range R_c = G_first,c - G_last,c stays within FACTORED_RANGE on
every channel: each factor is then within e^{+-R_c / 2}, and the products above the diagonal (up to
e^{R_c}, finite) are masked after it. A block that forgets faster (past e^-5 a token on average) has
its diagonal summed exactly, one column (or row) at a time over the channels, each exponent masked
to -inf above the diagonal before exp. The choice is made per block at run time, so no input ever
compiles another kernel.
"""
import triton
import triton.language as tl

from ..gated_delta_rule.common import (
    _block_inverse,  # the GDN package's exact 16 x 16 forward substitution, reused as is
    _store_block_row,
    load_rows,
    load_token_rows,
)

# The largest decay range over a diagonal block (natural log, per channel) that factors through its
# midpoint: factors up to e^40, products up to e^80, within fp32's and bf16's e^88 (fp16's e^11 is not:
# fp16 inputs multiply these factors in fp32).
FACTORED_RANGE = tl.constexpr(80.0)


@triton.jit
def load_row(ptr, row, head, num_heads: tl.constexpr, width: tl.constexpr, BD: tl.constexpr):
    """[BD] row `row` of one head of a [rows, heads, width] buffer, zeros past `width`."""
    cols = tl.arange(0, BD)
    return tl.load(ptr + (row.to(tl.int64) * num_heads + head) * width + cols, mask=cols < width, other=0.)


@triton.jit
def load_block_beta(beta, src0, real, hv, HV: tl.constexpr, R: tl.constexpr):
    """beta of R tokens from the caller's [tokens, HV], fp32, zero past `real` (padding keeps the state)."""
    i = tl.arange(0, R)
    return tl.load(beta + (src0 + i) * HV + hv, mask=i < real, other=0.).to(tl.float32)


@triton.jit
def block_midpoint(cum, row, hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """The 16-row block of `cum` from padded row `row`: its decay midpoint [BK] and whether the block
    factors through it (every channel's range within FACTORED_RANGE)."""
    first = load_row(cum, row, hv, HV, K, BK)
    last = load_row(cum, row + 15, hv, HV, K, BK)
    return (first + last) * 0.5, tl.max(first - last, axis=0) <= FACTORED_RANGE


@triton.jit
def factored_dot(a, b, like, PREC: tl.constexpr):
    """a @ b of fp32 tiles holding midpoint factors: bf16 operands when `like` (a pointer) is bf16,
    fp32 ones (at PREC) otherwise, since fp16 cannot hold e^40."""
    if like.dtype.element_ty == tl.bfloat16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def summed_diagonal_pair(q, k, cum, src0, real, row0, a, qk_head, hv, H: tl.constexpr, HV: tl.constexpr,
                         K: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr):
    """Diagonal block (a, a) of P(Q) and P(K) of the chunk starting at padded row row0 (caller rows
    src0.., `real` real tokens), for a block that forgets too fast for midpoint factors: two [16, 16]
    fp32 tiles, P(Q) with its diagonal, P(K) strictly lower (all that A = strictLower(diag(beta) P(K))
    reads), summed over the channels KC at a time, as [16, 16, KC] tiles."""
    ra = 16 * a
    i = tl.arange(0, 16)
    p_q = tl.zeros([16, 16], dtype=tl.float32)
    p_k = tl.zeros([16, 16], dtype=tl.float32)
    causal = (i[:, None] >= i[None, :])[:, :, None]
    for c0 in tl.range(0, BK, KC):
        q_c = load_token_rows(q, src0 + ra, real - ra, qk_head, H, K, 16, KC, c0).to(tl.float32)
        k_c = load_token_rows(k, src0 + ra, real - ra, qk_head, H, K, 16, KC, c0).to(tl.float32)
        g_c = load_rows(cum, row0 + ra, hv, HV, K, 16, KC, c0)
        decay = tl.exp(tl.where(causal, g_c[:, None, :] - g_c[None, :, :], float("-inf")))
        k_decayed = k_c[None, :, :] * decay                                      # [i, j, c]
        p_q += tl.sum(q_c[:, None, :] * k_decayed, axis=2)
        p_k += tl.sum(k_c[:, None, :] * k_decayed, axis=2)
    return p_q, tl.where(i[:, None] > i[None, :], p_k, 0.)


@triton.jit
def summed_diagonal_row_grads(dpq, dpk, k, cum, src0, real, row0, rr, qk_head, hv, H: tl.constexpr,
                              HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                              JG: tl.constexpr):
    """The diagonal block's part of dX_ic = sum_{j <= i} dP_ij K_jc exp(G_ic - G_jc) for rows rr..rr+15,
    summed exactly (a block that forgets too fast for midpoint factors): JG columns j at a time, as
    [16, JG, BK] tiles. Two [16, BK] fp32 tiles, for dP(Q) and dP(K)."""
    i = tl.arange(0, 16)
    jj = tl.arange(0, JG)
    g_r = load_rows(cum, row0 + rr, hv, HV, K, 16, BK)
    acc_q = tl.zeros([16, BK], dtype=tl.float32)
    acc_k = tl.zeros([16, BK], dtype=tl.float32)
    for j0 in tl.range(0, 16, JG):
        k_j = load_token_rows(k, src0 + rr + j0, real - rr - j0, qk_head, H, K, JG, BK).to(tl.float32)
        g_j = load_rows(cum, row0 + rr + j0, hv, HV, K, JG, BK)
        causal = (i[:, None] >= j0 + jj[None, :])[:, :, None]
        exponent = tl.where(causal, g_r[:, None, :] - g_j[None, :, :], float("-inf"))         # [i, j, c]
        k_decayed = k_j[None, :, :] * tl.exp(exponent)
        dp_q_cols = load_rows(dpq, row0 + rr, hv, HV, C, 16, JG, rr + j0)              # [i, j]
        dp_k_cols = load_rows(dpk, row0 + rr, hv, HV, C, 16, JG, rr + j0)
        acc_q += tl.sum(dp_q_cols[:, :, None] * k_decayed, axis=1)
        acc_k += tl.sum(dp_k_cols[:, :, None] * k_decayed, axis=1)
    return acc_q, acc_k


@triton.jit
def summed_diagonal_column_grads(dpq, dpk, q, k, cum, src0, real, row0, rr, qk_head, hv, H: tl.constexpr,
                                 HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                                 JG: tl.constexpr):
    """The diagonal block's part of dK_jc = sum_{i >= j} dP_ij X_ic exp(G_ic - G_jc) for rows (keys)
    rr..rr+15, for (dP(Q), X = Q) and (dP(K), X = K), summed exactly: JG rows i at a time, as
    [JG, 16, BK] tiles. Two [16, BK] fp32 tiles."""
    j = tl.arange(0, 16)
    ii = tl.arange(0, JG)
    g_r = load_rows(cum, row0 + rr, hv, HV, K, 16, BK)
    acc_q = tl.zeros([16, BK], dtype=tl.float32)
    acc_k = tl.zeros([16, BK], dtype=tl.float32)
    for i0 in tl.range(0, 16, JG):
        q_i = load_token_rows(q, src0 + rr + i0, real - rr - i0, qk_head, H, K, JG, BK).to(tl.float32)
        k_i = load_token_rows(k, src0 + rr + i0, real - rr - i0, qk_head, H, K, JG, BK).to(tl.float32)
        g_i = load_rows(cum, row0 + rr + i0, hv, HV, K, JG, BK)
        causal = (i0 + ii[:, None] >= j[None, :])[:, :, None]
        decay = tl.exp(tl.where(causal, g_i[:, None, :] - g_r[None, :, :], float("-inf")))      # [i, j, c]
        dp_q_rows = load_rows(dpq, row0 + rr + i0, hv, HV, C, JG, 16, rr)              # [i, j]
        dp_k_rows = load_rows(dpk, row0 + rr + i0, hv, HV, C, JG, 16, rr)
        acc_q += tl.sum((dp_q_rows[:, :, None] * q_i[:, None, :]) * decay, axis=0)
        acc_k += tl.sum((dp_k_rows[:, :, None] * k_i[:, None, :]) * decay, axis=0)
    return acc_q, acc_k


@triton.jit
def unit_lower_inverse_from_blocks(a00, a10, a11, a20, a21, a22, a30, a31, a32, a33, t_inv, row0, hv,
                                   HV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^-1 of one chunk from the ten 16 x 16 blocks of the strictly lower A, stored to
    t_inv [Tp, HV, C]: the GDN kernels' blocked forward substitution (gated_delta_rule/common.py,
    `unit_lower_inverse`), whose products are all of bounded matrices, never a power series."""
    tl.static_assert(C == 64, "the UT inverse is written for chunks of 4 x 16 tokens")
    t00 = _block_inverse(a00)
    t11 = _block_inverse(a11)
    t22 = _block_inverse(a22)
    t33 = _block_inverse(a33)
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=PREC), input_precision=PREC)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=PREC), input_precision=PREC)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=PREC) + tl.dot(a21, t10, input_precision=PREC),
                  input_precision=PREC)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=PREC), input_precision=PREC)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=PREC) + tl.dot(a32, t21, input_precision=PREC),
                  input_precision=PREC)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=PREC) + tl.dot(a31, t10, input_precision=PREC)
                  + tl.dot(a32, t20, input_precision=PREC), input_precision=PREC)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_block_row(t_inv, t00, zero, zero, zero, row0, hv, HV, C)
    _store_block_row(t_inv, t10, t11, zero, zero, row0 + 16, hv, HV, C)
    _store_block_row(t_inv, t20, t21, t22, zero, row0 + 32, hv, HV, C)
    _store_block_row(t_inv, t30, t31, t32, t33, row0 + 48, hv, HV, C)


def diagonal_group(BK: int, tile: int) -> int:
    """Rows (or columns) of a diagonal block the backward takes at once: [16, group, BK] tiles of about
    `tile` fp32 values (registers on a GPU; in the interpreter, fewer and larger steps are faster)."""
    return max(1, min(16, tile // (16 * BK)))


def channel_group(BK: int, group: int) -> int:
    """Channels of a diagonal block the forward sums at once, as [16, 16, group] tiles."""
    return min(BK, group)


def key_block(K: int) -> int:
    """All K key columns in one tile (K <= 256), at least 32 wide: the GDN kernels' choice
    (gated_delta_rule/__init__.py, `_key_block`: 16-column tiles misbuilt on Hopper with Triton 3.6)."""
    return max(32, triton.next_power_of_2(K))
