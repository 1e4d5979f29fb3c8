"""Chunked gated delta rule in PyTorch (docs/design.md §1): runs anywhere, autograd through it.

Per chunk of C tokens, with gamma = cumsum(g) inside the chunk and Gamma_ij = exp(gamma_i - gamma_j):
    T = (I + strictLower(diag(beta) (Gamma o K K^T)))^-1 diag(beta)
    W = T diag(exp(gamma)) K,  U = T V           (the UT transform)
    Delta = U - W S                              (what the chunk writes, given the incoming state S)
    S_next = exp(gamma_C) S + (K o exp(gamma_C - gamma))^T Delta
    O = scale (diag(exp(gamma)) Q S + (Q K^T o Gamma o causal) Delta)
Everything but the recurrence over chunks is independent of S, so it is computed for all chunks at
once (`ChunkFactors`), which is also what context parallelism overlaps with the incoming state.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from gdn_kernels.chunk_layout import ChunkLayout


class ChunkTransitions(Protocol):
    """What the chunk recurrence and a context-parallel rank's summary read of chunk factors: the gated
    delta rule's (ChunkFactors) and Kimi Delta Attention's (ops/kda/chunk.py, a decay per key channel)."""
    w: torch.Tensor
    u: torch.Tensor
    k_to_end: torch.Tensor
    chunk_decay: torch.Tensor

    def transition(self, index) -> tuple: ...


@dataclass
class ChunkFactors:
    """State-independent per-chunk quantities, layout [chunks, HV, C, ...] in the compute dtype."""
    w: torch.Tensor            # [n, HV, C, K]
    u: torch.Tensor            # [n, HV, C, V]
    k_to_end: torch.Tensor     # [n, HV, C, K]  k_j * exp(gamma_C - gamma_j)
    q_decayed: torch.Tensor    # [n, HV, C, K]  scale * q_i * exp(gamma_i)
    qk_masked: torch.Tensor    # [n, HV, C, C]  scale * (q_i . k_j) exp(gamma_i - gamma_j), j <= i
    chunk_decay: torch.Tensor  # [n, HV]        exp(gamma_C)

    def transition(self, index) -> tuple:
        """(M, S) with S_next = M S_in + S for the selected chunks (M: [., HV, K, K])."""
        k_to_end, w = self.k_to_end[index], self.w[index]
        eye = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)
        m = self.chunk_decay[index][..., None, None] * eye - k_to_end.transpose(-1, -2) @ w
        return m, k_to_end.transpose(-1, -2) @ self.u[index]


def chunk_factors(q, k, v, g, beta, scale: float) -> ChunkFactors:
    """Inputs [n, C, HV, *] (chunked, compute dtype). All chunks at once, no dependence on the state."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))          # [n, HV, C, *]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)          # [n, HV, C]
    C = q.shape[-2]
    gamma = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: above the diagonal gamma_i - gamma_j >= 0 can be large and would overflow.
    gamma_diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf"))
    decay_ij = gamma_diff.exp()                                              # [n, HV, C, C]
    strict = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay_ij).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    unit_lower = eye + strict
    rhs = torch.cat([k * (beta * gamma.exp())[..., None], v * beta[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    w, u = solved.split([k.shape[-1], v.shape[-1]], dim=-1)
    return ChunkFactors(
        w=w, u=u,
        k_to_end=k * (gamma[..., -1:] - gamma).exp()[..., None],
        q_decayed=q * (gamma.exp() * scale)[..., None],
        qk_masked=(q @ k.transpose(-1, -2)) * decay_ij * scale,
        chunk_decay=gamma[..., -1].exp(),
    )


def decay_state(chunk_decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """exp(gamma_C) S: chunk_decay [., HV] scales each head's state, [., HV, K] (Kimi Delta Attention's
    decay per key channel) each row of it; state [., HV, K, V]."""
    per_channel = chunk_decay.dim() == state.dim() - 1
    return (chunk_decay[..., None] if per_channel else chunk_decay[..., None, None]) * state


def chunk_recurrence(factors: ChunkTransitions, layout: ChunkLayout, initial_state: torch.Tensor):
    """Hand the state from chunk to chunk of every document.

    Takes any factors with the fields of ChunkFactors, the chunk decay per head or per key channel
    (`decay_state`): Kimi Delta Attention's (ops/kda/chunk.py) walk the same way.
    Returns (state at the start of every chunk [n, HV, K, V], final state per document [N, HV, K, V]).
    Step i advances the i-th chunk of every document that has one, so the loop is as long as the
    longest document, not the whole row.
    """
    state = initial_state
    starts, order = [], []
    device = state.device
    # Documents sorted longest first: the ones still active at step i are a prefix of this order.
    by_length = sorted(range(layout.num_docs), key=lambda d: -layout.doc_num_chunks[d])
    by_length_t = torch.tensor(by_length, dtype=torch.long, device=device)
    first_chunk = torch.tensor(layout.doc_first_chunk, dtype=torch.long, device=device)
    active = layout.num_docs
    for step in range(layout.max_chunks):
        while layout.doc_num_chunks[by_length[active - 1]] <= step:
            active -= 1
        doc_index = by_length_t[:active]
        chunks = first_chunk.index_select(0, doc_index) + step
        everyone = active == layout.num_docs
        current = state.index_select(0, doc_index)
        starts.append(current)
        order.append(chunks)
        delta = factors.u[chunks] - factors.w[chunks] @ current
        advanced = (decay_state(factors.chunk_decay[chunks], current)
                    + factors.k_to_end[chunks].transpose(-1, -2) @ delta)
        state = advanced.index_select(0, torch.argsort(doc_index)) if everyone \
            else state.index_copy(0, doc_index, advanced)
    if not starts:
        return initial_state.new_zeros(0, *initial_state.shape[1:]), state
    order_all = torch.cat(order)
    chunk_states = torch.cat(starts).index_select(0, torch.argsort(order_all))
    return chunk_states, state


def chunk_outputs(factors: ChunkFactors, chunk_states: torch.Tensor) -> torch.Tensor:
    """O = scale (exp(gamma) Q S + (QK^T o Gamma o causal)(U - W S)), [n, HV, C, V] -> [n, C, HV, V]."""
    delta = factors.u - factors.w @ chunk_states
    o = factors.q_decayed @ chunk_states + factors.qk_masked @ delta
    return o.transpose(1, 2)


@dataclass(frozen=True)
class ChunkRule:
    """A delta rule's PyTorch chunk form as data: the gated delta rule's, or Kimi Delta Attention's
    (ops/kda). Both keep a [K, V] state per head, so the chunk walk (`run_chunk_rule`), the
    context-parallel hand-over, the summaries and their fold (cp.py) are the same."""
    factors: Callable    # (q, k, v, g, beta, scale) chunked [n, C, HV, *] -> ChunkTransitions
    outputs: Callable    # (factors, chunk states [n, HV, K, V]) -> [n, C, HV, V]


def run_chunk_rule(rule: ChunkRule, q, k, v, g, beta, scale: float, layout: ChunkLayout,
                   initial_state: torch.Tensor | None):
    """Flat packed inputs [total, HV, *] (q/k already expanded to HV heads), computed in fp32 for half
    inputs (float64 for float64). Returns (o [total, HV, V] in v's dtype, final states [N, HV, K, V] in
    the compute dtype)."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    HV, K, V = v.shape[1], k.shape[-1], v.shape[-1]
    q_c, k_c, v_c, g_c, beta_c = (layout.pad(x.to(dtype)) for x in (q, k, v, g, beta))
    factors = rule.factors(q_c, k_c, v_c, g_c, beta_c, scale)
    if initial_state is None:
        initial_state = torch.zeros(layout.num_docs, HV, K, V, dtype=dtype, device=v.device)
    chunk_states, final_state = chunk_recurrence(factors, layout, initial_state.to(dtype))
    o = rule.outputs(factors, chunk_states)
    return layout.unpad(o).to(v.dtype), final_state


GATED_DELTA_RULE = ChunkRule(chunk_factors, chunk_outputs)


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float, layout: ChunkLayout,
                           initial_state: torch.Tensor | None):
    """Flat packed inputs [total, HV, *] (q/k already expanded to HV heads; g [total, HV]): see
    run_chunk_rule."""
    return run_chunk_rule(GATED_DELTA_RULE, q, k, v, g, beta, scale, layout, initial_state)
