"""Pieces shared by the forward and backward kernels of the chunked gated delta rule.

Tensors are token-major and chunk-aligned: [Tp, heads, D] with Tp a multiple of the chunk size C and
every chunk inside one document (documents padded at their ends). The caller's own tensors (v, the
output, its gradient and dv) stay unpadded: kernels reach their rows through the chunk table
(`chunk_tokens`, `load_token_rows`, `store_token_rows`; kernels/chunk_layout.py). `gamma` is the fp32
cumulative log decay inside each chunk, stored head-major [HV, Tp] so that a chunk's 64 values are one
contiguous load. Value head `hv` reads query/key head `hv // (HV // H)`.
"""
import triton
import triton.language as tl


@triton.jit
def load_rows(ptr, row0, head, num_heads: tl.constexpr, width: tl.constexpr,
              C: tl.constexpr, BD: tl.constexpr, col0=0):
    """[C, BD] tile of rows row0..row0+C-1, columns col0.. of one head of a [rows, heads, width] tensor."""
    rows = row0.to(tl.int64) + tl.arange(0, C)  # int64: rows x heads x width passes 2^31 near 1M tokens
    cols = col0 + tl.arange(0, BD)
    mask = (cols < width)[None, :]
    return tl.load(ptr + (rows[:, None] * num_heads + head) * width + cols[None, :], mask=mask, other=0.)


@triton.jit
def store_rows(ptr, value, row0, head, num_heads: tl.constexpr, width: tl.constexpr,
               C: tl.constexpr, BD: tl.constexpr, col0=0):
    rows = row0.to(tl.int64) + tl.arange(0, C)
    cols = col0 + tl.arange(0, BD)
    mask = (cols < width)[None, :]
    tl.store(ptr + (rows[:, None] * num_heads + head) * width + cols[None, :],
             value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def chunk_tokens(chunk_rows, chunk):
    """(the caller's row of the chunk's first token, int64; the chunk's number of real tokens) from the
    [chunks, 2] table: the chunk's rows past its real tokens are document padding."""
    entry = chunk_rows + 2 * chunk.to(tl.int64)
    return tl.load(entry), tl.load(entry + 1)


@triton.jit
def load_token_rows(ptr, src0, real, head, num_heads: tl.constexpr, width: tl.constexpr,
                    C: tl.constexpr, BD: tl.constexpr, col0=0):
    """load_rows of a chunk from the caller's unpadded tensor: rows src0.. of it, zeros past `real`."""
    i = tl.arange(0, C)
    cols = col0 + tl.arange(0, BD)
    mask = (i < real)[:, None] & (cols < width)[None, :]
    return tl.load(ptr + ((src0 + i)[:, None] * num_heads + head) * width + cols[None, :], mask=mask,
                   other=0.)


@triton.jit
def store_token_rows(ptr, value, src0, real, head, num_heads: tl.constexpr, width: tl.constexpr,
                     C: tl.constexpr, BD: tl.constexpr, col0=0):
    """store_rows of a chunk's real tokens into the caller's unpadded tensor; padding rows are dropped."""
    i = tl.arange(0, C)
    cols = col0 + tl.arange(0, BD)
    mask = (i < real)[:, None] & (cols < width)[None, :]
    tl.store(ptr + ((src0 + i)[:, None] * num_heads + head) * width + cols[None, :],
             value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_state(ptr, index, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, col0,
               key0=0):
    """[BK, BV] block (key rows key0.., value columns col0..) of state `index` of a [*, K, V] tensor."""
    r = key0 + tl.arange(0, BK)
    c = col0 + tl.arange(0, BV)
    mask = (r < K)[:, None] & (c < V)[None, :]
    # int64: chunks x heads x K x V reaches 2^31 at 512K tokens (8 heads, K = 128, V = 256)
    return tl.load(ptr + index.to(tl.int64) * K * V + r[:, None] * V + c[None, :], mask=mask, other=0.)


@triton.jit
def store_state(ptr, value, index, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                col0):
    r = tl.arange(0, BK)
    c = col0 + tl.arange(0, BV)
    mask = (r < K)[:, None] & (c < V)[None, :]
    tl.store(ptr + index.to(tl.int64) * K * V + r[:, None] * V + c[None, :], value.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def load_gamma(gamma, row0, hv, Tp, C: tl.constexpr):
    """(gamma of the chunk's C tokens, gamma of its last token) for value head hv."""
    base = gamma + hv * Tp + row0
    return tl.load(base + tl.arange(0, C)), tl.load(base + C - 1)


@triton.jit
def decay_matrix(gam, C: tl.constexpr, STRICT: tl.constexpr):
    """Gamma_ij = exp(gamma_i - gamma_j) on the causal triangle (strictly below it if STRICT), else 0.
    The mask goes in before the exp: above the diagonal the exponent is >= 0 and may overflow."""
    i = tl.arange(0, C)
    if STRICT:
        keep = i[:, None] > i[None, :]
    else:
        keep = i[:, None] >= i[None, :]
    return tl.exp(tl.where(keep, gam[:, None] - gam[None, :], float("-inf")))


@triton.jit
def _block_inverse(a):
    """(I + A)^-1 of a strictly lower [16, 16] block A, by forward substitution one row at a time:
    row r of T is e_r - A[r, :] T, from rows already final. Exact up to rounding whatever the size of
    A's entries; no intermediate is larger than T itself."""
    i = tl.arange(0, 16)
    t = tl.where(i[:, None] == i[None, :], 1., 0.)
    for r in tl.static_range(1, 16):
        a_row = tl.sum(tl.where(i[:, None] == r, a, 0.), axis=0)
        t = t - tl.where(i[:, None] == r, tl.sum(a_row[:, None] * t, axis=0)[None, :], 0.)
    return t


@triton.jit
def _gram_block(k, beta, gamma, row0, i: tl.constexpr, j: tl.constexpr, hv, Tp, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Block (i, j) of A = strictLower(diag(beta) (K K^T o Gamma)): rows 16i.., columns 16j.. of a chunk."""
    ri, rj = row0 + i * 16, row0 + j * 16
    k_i = load_rows(k, ri, hv // (HV // H), H, K, 16, BK)
    k_j = load_rows(k, rj, hv // (HV // H), H, K, 16, BK)
    b_i = tl.load(beta + (ri + tl.arange(0, 16)) * HV + hv).to(tl.float32)
    gam_i = tl.load(gamma + hv * Tp + ri + tl.arange(0, 16))
    if i == j:
        decay = decay_matrix(gam_i, 16, True)
    else:  # every row of block i comes after every column of block j: the exponent is <= 0
        gam_j = tl.load(gamma + hv * Tp + rj + tl.arange(0, 16))
        decay = tl.exp(gam_i[:, None] - gam_j[None, :])
    return tl.dot(k_i, tl.trans(k_j)) * decay * b_i[:, None]


@triton.jit
def unit_lower_inverse(k, beta, gamma, t_inv, row0, hv, Tp, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^-1 of one chunk (C = 64: 4 x 4 blocks of 16), stored to t_inv [Tp, HV, C].

    Blocked forward substitution: the diagonal blocks by rows (_block_inverse), then block row i from
    T_ij = -T_ii sum_{j <= m < i} A_im T_mj. Every product is of bounded matrices. A power series in
    A (e.g. (I - A)(I + A^2)(I + A^4)...) is not: when keys in a chunk are alike (a repeated token)
    and decay is weak, A's rows approach all-ones, the terms of A^m grow like binomial coefficients
    (~1e17 at C = 64) and cancel, and fp32 or TF32 rounding of them leaves garbage or inf in T."""
    tl.static_assert(C == 64, "the UT inverse is written for chunks of 4 x 16 tokens")
    a10 = _gram_block(k, beta, gamma, row0, 1, 0, hv, Tp, H, HV, K, BK)
    a20 = _gram_block(k, beta, gamma, row0, 2, 0, hv, Tp, H, HV, K, BK)
    a21 = _gram_block(k, beta, gamma, row0, 2, 1, hv, Tp, H, HV, K, BK)
    a30 = _gram_block(k, beta, gamma, row0, 3, 0, hv, Tp, H, HV, K, BK)
    a31 = _gram_block(k, beta, gamma, row0, 3, 1, hv, Tp, H, HV, K, BK)
    a32 = _gram_block(k, beta, gamma, row0, 3, 2, hv, Tp, H, HV, K, BK)
    t00 = _block_inverse(_gram_block(k, beta, gamma, row0, 0, 0, hv, Tp, H, HV, K, BK))
    t11 = _block_inverse(_gram_block(k, beta, gamma, row0, 1, 1, hv, Tp, H, HV, K, BK))
    t22 = _block_inverse(_gram_block(k, beta, gamma, row0, 2, 2, hv, Tp, H, HV, K, BK))
    t33 = _block_inverse(_gram_block(k, beta, gamma, row0, 3, 3, hv, Tp, H, HV, K, BK))
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


@triton.jit
def _store_block_row(t_inv, b0, b1, b2, b3, row0, hv, HV: tl.constexpr, C: tl.constexpr):
    store_rows(t_inv, b0, row0, hv, HV, C, 16, 16, 0)
    store_rows(t_inv, b1, row0, hv, HV, C, 16, 16, 16)
    store_rows(t_inv, b2, row0, hv, HV, C, 16, 16, 32)
    store_rows(t_inv, b3, row0, hv, HV, C, 16, 16, 48)


@triton.jit
def load_value_columns(ptr, row0, real, head, num_heads: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                       C: tl.constexpr, cols):
    """Rows row0.. of a [rows, heads, V] tensor (zeros past `real`) seen through an extended width
    K + V: columns < K read 0 (the part of a span summary that carries the identity), column c >= K
    reads value column c - K."""
    i = tl.arange(0, C)
    rows = row0.to(tl.int64) + i
    mask = (i < real)[:, None] & ((cols >= K) & (cols < K + V))[None, :]
    return tl.load(ptr + (rows[:, None] * num_heads + head) * V + (cols - K)[None, :], mask=mask, other=0.)


@triton.jit
def identity_columns(cols, BK: tl.constexpr, K: tl.constexpr):
    """[BK, len(cols)] block of [I_K | 0]."""
    r = tl.arange(0, BK)
    return tl.where((r[:, None] == cols[None, :]) & (cols[None, :] < K), 1., 0.)


@triton.jit
def store_summary(ptr, value, span, hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, cols):
    """Block of a span summary [spans, HV, K, K + V]."""
    r = tl.arange(0, BK)
    mask = (r < K)[:, None] & (cols < K + V)[None, :]
    tl.store(ptr + (span * HV + hv) * K * (K + V) + r[:, None] * (K + V) + cols[None, :], value, mask=mask)
