"""Chunked Kimi Delta Attention in PyTorch: runs anywhere, autograd through it.

The gated delta rule's chunk form (gated_delta_rule/chunk.py, docs/design.md §1) with the decay per
key channel. Per chunk of C tokens, with G_i = g_1 + ... + g_i the cumulative log decay from the
chunk start ([C, K]) and the decayed products
    P(X)_ij = sum_c X_ic K_jc exp(G_ic - G_jc)        (j <= i, zero above the diagonal),
the token deltas u_t = beta_t (v_t - (Diag(alpha_t) S_{t-1})^T k_t) solve a unit lower-triangular
system, and the chunk reads and writes its start state S through decay-weighted keys and queries:
    T = (I + strictLower(diag(beta) P(K)))^-1 diag(beta)
    W = T (K o exp(G)),  U = T V                       (the UT transform)
    Delta = U - W S                                    (the token deltas, given the incoming state S)
    S_next = Diag(exp(G_C)) S + (K o exp(G_C - G))^T Delta
    O = scale ((Q o exp(G)) S + P(Q) Delta)
Every exponent is a sum of log decays (<= 0) over a stretch of the chunk, so no factor exceeds 1:
P is computed on blocks of up to 16 tokens (see `decayed_products`), never as
(X o exp(G)) (K o exp(-G))^T, whose second factor overflows once a channel decays strongly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gdn_kernels.chunk_layout import ChunkLayout

from ..gated_delta_rule.chunk import ChunkRule, run_chunk_rule

BLOCK = 16  # tokens per diagonal block of the decayed products


@dataclass
class KDAChunkFactors:
    """State-independent per-chunk quantities, layout [chunks, HV, C, ...] in the compute dtype.

    The fields of the gated delta rule's ChunkFactors, with the chunk decay a vector over the key
    channels. The output factors are None when built without queries (segment summaries need none)."""
    w: torch.Tensor                    # [n, HV, C, K]
    u: torch.Tensor                    # [n, HV, C, V]
    k_to_end: torch.Tensor             # [n, HV, C, K]  k_j o exp(G_C - G_j)
    q_decayed: torch.Tensor | None     # [n, HV, C, K]  scale * q_i o exp(G_i)
    qk_masked: torch.Tensor | None     # [n, HV, C, C]  scale * P(Q)
    chunk_decay: torch.Tensor          # [n, HV, K]     exp(G_C)

    def transition(self, index) -> tuple:
        """(M, S) with S_next = M S_in + S for the selected chunks (M: [., HV, K, K])."""
        k_to_end, w = self.k_to_end[index], self.w[index]
        m = torch.diag_embed(self.chunk_decay[index]) - k_to_end.transpose(-1, -2) @ w
        return m, k_to_end.transpose(-1, -2) @ self.u[index]


def block_size(chunk_size: int) -> int:
    """The largest divisor of the chunk size up to BLOCK (16 for chunks of 64)."""
    return max(d for d in range(1, min(BLOCK, chunk_size) + 1) if chunk_size % d == 0)


def _suffix_log_decay(g: torch.Tensor) -> torch.Tensor:
    """[.., L, K] -> sum of g over the tokens after j up to the end (exclusive of j), [.., L, K].

    A reverse cumsum, shifted: all terms share one sign, so it is accurate to its own magnitude,
    where G_end - G_j would cancel."""
    inclusive = g.flip(-2).cumsum(-2).flip(-2)
    return torch.cat([inclusive[..., 1:, :], torch.zeros_like(inclusive[..., :1, :])], dim=-2)


def decayed_products(x: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """P_ij = sum_c x_ic k_jc exp(G_ic - G_jc) for j <= i (0 above), G = cumsum(g): [.., C, C].

    x, k, g: [.., C, K]. The chunk is cut into blocks of w tokens (`block_size`). Inside a diagonal
    block the exponents G_i - G_j (relative to the block, masked above the diagonal before exp) are
    spelt out per channel, [.., C, w, K]. Across blocks, token i of block a and token j of block
    b < a factor through the block edges, each factor at most 1:
        exp(G_i - G_j) = exp(G_i - G_start(a)) exp(G_start(a) - G_end(b)) exp(G_end(b) - G_j).
    """
    *lead, C, K = k.shape
    width = block_size(C)
    n = C // width
    xb, kb, gb = (t.reshape(*lead, n, width, K) for t in (x, k, g))
    from_start = gb.cumsum(-2)                          # G_i - G_start(block), <= 0
    causal = torch.ones(width, width, dtype=torch.bool, device=k.device).tril()
    # Mask before exp: above the diagonal the exponent is >= 0 and may overflow.
    exponent = (from_start[..., :, None, :] - from_start[..., None, :, :]).masked_fill(~causal[..., None],
                                                                                       float("-inf"))
    diagonal = (xb[..., :, None, :] * kb[..., None, :, :] * exponent.exp()).sum(-1)   # [.., n, w, w]
    eye_blocks = torch.eye(n, dtype=k.dtype, device=k.device)
    blocks = diagonal.unsqueeze(-3) * eye_blocks[:, :, None, None]                     # [.., n, n, w, w]
    if n > 1:
        x_from_start = xb * from_start.exp()
        k_to_end = kb * _suffix_log_decay(gb).exp()
        # log decay of the blocks strictly between b and a: sum of block totals m with b < m < a
        index = torch.arange(n, device=k.device)
        between = ((index[None, :, None] < index[None, None, :])
                   & (index[None, None, :] < index[:, None, None])).to(k.dtype)      # [a, b, m]
        gap = torch.einsum("abm,...mc->...abc", between, from_start[..., -1, :])
        gap_decay = gap.exp() * torch.ones(n, n, dtype=k.dtype, device=k.device).tril(-1)[..., None]
        blocks = blocks + torch.einsum("...aic,...abc,...bjc->...abij", x_from_start, gap_decay, k_to_end)
    return blocks.transpose(-3, -2).reshape(*lead, C, C)


def chunk_factors(q: torch.Tensor | None, k, v, g, beta, scale: float) -> KDAChunkFactors:
    """Inputs [n, C, HV, *] (chunked, compute dtype; g [n, C, HV, K]). All chunks at once, no
    dependence on the state. Without q (None) only the transition factors are built. The gated delta
    rule's chunk recurrence walks them (its `decay_state` takes the per-channel chunk decay)."""
    k, v, g = (x.transpose(1, 2) for x in (k, v, g))           # [n, HV, C, *]
    beta = beta.transpose(1, 2)                                # [n, HV, C]
    C = k.shape[-2]
    cumulative = g.cumsum(-2)                                  # G_i, from the chunk start
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    unit_lower = eye + (beta[..., None] * decayed_products(k, k, g)).tril(-1)
    rhs = torch.cat([k * cumulative.exp() * beta[..., None], v * beta[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    w, u = solved.split([k.shape[-1], v.shape[-1]], dim=-1)
    q_decayed = qk_masked = None
    if q is not None:
        q = q.transpose(1, 2)
        q_decayed = q * cumulative.exp() * scale
        qk_masked = decayed_products(q, k, g) * scale
    return KDAChunkFactors(w=w, u=u, k_to_end=k * _suffix_log_decay(g).exp(), q_decayed=q_decayed,
                           qk_masked=qk_masked, chunk_decay=cumulative[..., -1, :].exp())


def chunk_outputs(factors: KDAChunkFactors, chunk_states: torch.Tensor) -> torch.Tensor:
    """O = (scale Q o exp(G)) S + scale P(Q) (U - W S), [n, HV, C, V] -> [n, C, HV, V]."""
    if factors.q_decayed is None or factors.qk_masked is None:
        raise ValueError("these chunk factors were built without queries (q=None); build them with q to "
                         "compute outputs")
    delta = factors.u - factors.w @ chunk_states
    o = factors.q_decayed @ chunk_states + factors.qk_masked @ delta
    return o.transpose(1, 2)


KIMI_DELTA_ATTENTION = ChunkRule(chunk_factors, chunk_outputs)


def chunk_kda(q, k, v, g, beta, scale: float, layout: ChunkLayout, initial_state: torch.Tensor | None):
    """Flat packed inputs [total, HV, *] (q/k already expanded to HV heads; g [total, HV, K]): the
    gated delta rule's chunk walk (run_chunk_rule) with KDA's factors."""
    return run_chunk_rule(KIMI_DELTA_ATTENTION, q, k, v, g, beta, scale, layout, initial_state)
