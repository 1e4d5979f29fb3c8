"""Pieces shared by the forward and backward kernels of the chunked gated delta rule.

Tensors are token-major and chunk-aligned: [Tp, heads, D] with Tp a multiple of the chunk size C and
every chunk inside one document (the wrapper pads documents). `gamma` is the fp32 cumulative log
decay inside each chunk, stored head-major [HV, Tp] so that a chunk's 64 values are one contiguous
load. Value head `hv` reads query/key head `hv // (HV // H)`.
"""
import triton
import triton.language as tl


@triton.jit
def load_rows(ptr, row0, head, num_heads: tl.constexpr, width: tl.constexpr,
              C: tl.constexpr, BD: tl.constexpr, col0=0):
    """[C, BD] tile of rows row0..row0+C-1, columns col0.. of one head of a [rows, heads, width] tensor."""
    rows = row0 + tl.arange(0, C)
    cols = col0 + tl.arange(0, BD)
    mask = (cols < width)[None, :]
    return tl.load(ptr + (rows[:, None] * num_heads + head) * width + cols[None, :], mask=mask, other=0.)


@triton.jit
def store_rows(ptr, value, row0, head, num_heads: tl.constexpr, width: tl.constexpr,
               C: tl.constexpr, BD: tl.constexpr, col0=0):
    rows = row0 + tl.arange(0, C)
    cols = col0 + tl.arange(0, BD)
    mask = (cols < width)[None, :]
    tl.store(ptr + (rows[:, None] * num_heads + head) * width + cols[None, :],
             value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_state(ptr, index, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, col0):
    """[BK, BV] block of state `index` of a [*, K, V] tensor."""
    r = tl.arange(0, BK)
    c = col0 + tl.arange(0, BV)
    mask = (r < K)[:, None] & (c < V)[None, :]
    return tl.load(ptr + index * K * V + r[:, None] * V + c[None, :], mask=mask, other=0.)


@triton.jit
def store_state(ptr, value, index, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                col0):
    r = tl.arange(0, BK)
    c = col0 + tl.arange(0, BV)
    mask = (r < K)[:, None] & (c < V)[None, :]
    tl.store(ptr + index * K * V + r[:, None] * V + c[None, :], value.to(ptr.dtype.element_ty), mask=mask)


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
def chunk_gram(k, beta, gamma, chunk, hv, Tp, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr):
    """Keys, beta, gamma and A = strictLower(diag(beta) (K K^T o Gamma)) of one chunk and head."""
    row0 = chunk * C
    kk = load_rows(k, row0, hv // (HV // H), H, K, C, BK)
    b = tl.load(beta + (row0 + tl.arange(0, C)) * HV + hv).to(tl.float32)
    gam, _ = load_gamma(gamma, row0, hv, Tp, C)
    gram = tl.dot(kk, tl.trans(kk))
    a = gram * decay_matrix(gam, C, True) * b[:, None]
    return kk, b, gam, gram, a


@triton.jit
def unit_lower_inverse(a, C: tl.constexpr, LOG2C: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^-1 for strictly lower triangular A (fp32).

    N = -A is nilpotent (N^C = 0), so (I - N)^-1 = sum_{m<C} N^m = (I + N)(I + N^2)(I + N^4)...
    (I + N^{C/2}): log2(C) squarings instead of a C-step substitution.
    """
    i = tl.arange(0, C)
    power = -a
    inverse = tl.where(i[:, None] == i[None, :], 1., 0.) + power
    for _ in tl.static_range(LOG2C - 1):
        power = tl.dot(power, power, input_precision=PREC)
        inverse = inverse + tl.dot(inverse, power, input_precision=PREC)
    return inverse


@triton.jit
def load_value_columns(ptr, row0, head, num_heads: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                       C: tl.constexpr, cols):
    """Rows of a [rows, heads, V] tensor seen through an extended width K + V: columns < K read 0
    (the part of a span summary that carries the identity), column c >= K reads value column c - K."""
    rows = row0 + tl.arange(0, C)
    mask = ((cols >= K) & (cols < K + V))[None, :]
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
