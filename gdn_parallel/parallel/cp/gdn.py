"""Gated delta rule on a contiguous shard of a longer sequence (DESIGN §2).

relay: post the receive of the incoming state, compute everything that does not need it (the
chunk factors), wait, run the inter-chunk recurrence, send the final state to rank r + 1 at once,
then compute the outputs. Backward mirrors it through p2p's autograd wiring.

allgather: summarise the shard's last document piece as (M, S_loc), all-gather the summaries, fold
the prefix into the incoming state, then run the local recurrence from it. Autograd through the
all-gather and the fold gives the mirrored backward (M^T chain).

impl="triton" runs the local work with the fused kernels (gdn_kernels.gated_delta_rule): the relay
hands the incoming state to the kernels as an initial state and sends their final state on; the
allgather summary is one kernel run over spans of the piece, each span started from [I | 0] with
values [0 | V], whose final states are the span pairs (M, S_loc), folded in a short loop.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...ops.gated_delta_rule.chunk import chunk_factors, chunk_outputs, chunk_recurrence
from ...ops.gated_delta_rule.layout import build_layout
from ...ops.gated_delta_rule.summary import fold_chunk_transitions
from ..context import CPContext, sequence_lengths
from .p2p import all_gather, post_recv_from_prev, send_to_next, tie


def cp_gated_delta_rule(q, k, v, g, beta, *, scale: float, cp: CPContext, chunk_size: int,
                        initial_state: Optional[torch.Tensor], output_final_state: bool, impl: str = "chunk"):
    """q, k expanded to HV heads: [1, L, HV, K]; v [1, L, HV, V]; g, beta [1, L, HV] (this rank's shard).

    initial_state: [docs starting on this rank, HV, K, V] or None. Returns (o [1, L, HV, V],
    final states of the documents that end on this rank or None).
    """
    if q.shape[0] != 1:
        raise ValueError(f"context parallelism takes one packed row (batch 1), got batch {q.shape[0]}")
    if initial_state is not None and initial_state.shape[0] != cp.docs_starting_here:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states but {cp.docs_starting_here} "
                         f"documents start on CP rank {cp.rank}: give states only for those")
    dtype = torch.promote_types(v.dtype, torch.float32)
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    anchors = tuple(x for x in (q, k, v, g, beta, initial_state) if x is not None)

    incoming = (post_recv_from_prev(cp, (1, HV, K, V), dtype, v.device)
                if cp.continues_from_prev and cp.algorithm == "relay" else None)

    if impl == "triton":
        return _triton(q, k, v, g, beta, scale, cp, initial_state, output_final_state, incoming, anchors)
    layout = build_layout(sequence_lengths(cp.local_cu_list), chunk_size, v.device)
    chunked = [layout.pad(x[0].to(dtype)) for x in (q, k, v, g, beta)]
    factors = chunk_factors(*chunked, scale=scale)
    starting = (torch.zeros(cp.docs_starting_here, HV, K, V, dtype=dtype, device=v.device)
                if initial_state is None else initial_state.to(dtype))

    token = None
    if cp.algorithm == "allgather":
        state_in, token = _allgather_incoming_state(factors, layout, cp, starting)
    else:
        state_in = incoming.wait(*anchors) if incoming is not None else None
    states = starting if state_in is None else torch.cat([state_in, starting])

    chunk_states, final = chunk_recurrence(factors, layout, states)
    if cp.continues_to_next and cp.algorithm == "relay":
        token = send_to_next(cp, final[-1:])
    o = layout.unpad(chunk_outputs(factors, chunk_states)).to(v.dtype).unsqueeze(0)
    o = tie(o, token)
    final_out = final[:cp.docs_ending_here] if output_final_state else None
    return o, final_out


def _allgather_incoming_state(factors, layout, cp: CPContext, starting):
    """Fold every earlier rank's summary of its last piece into this rank's incoming state."""
    last = layout.num_docs - 1
    first_chunk, n_chunks = layout.doc_first_chunk[last], layout.doc_num_chunks[last]
    m, s = factors.transition(slice(first_chunk, first_chunk + n_chunks))
    piece_layout = type(layout)(layout.chunk_size, 1, n_chunks * layout.chunk_size, layout.token_dest,
                                [0], [n_chunks], [layout.doc_lengths[last]])
    m_last, s_last = fold_chunk_transitions(m, s, piece_layout)
    return _gather_and_fold(m_last, s_last, cp, starting)


def _gather_and_fold(m_last, s_last, cp: CPContext, starting):
    """All-gather every rank's (M, S_loc) of its last piece; fold the earlier ranks' into this rank's
    incoming state. Returns (state or None, a zero token tying the all-gather into autograd)."""
    if not (cp.continues_from_prev and cp.num_local_docs == 1):
        # The last piece starts on this rank: its outgoing state does not depend on earlier ranks.
        s_last = m_last @ starting[-1:] + s_last
        m_last = torch.zeros_like(m_last)
    summaries = all_gather(cp, torch.cat([m_last, s_last], dim=-1)[0])       # [P, HV, K, K + V]
    # Every rank must run the all-gather's backward (a collective), used or not: tie it in.
    token = summaries.reshape(-1)[:1].sum() * 0
    if not cp.continues_from_prev:
        return None, token
    K = m_last.shape[-1]
    state = torch.zeros_like(s_last[0])
    for r in range(cp.rank):  # prefix fold: S_in(r + 1) = M_r S_in(r) + S_r
        state = summaries[r, ..., :K] @ state + summaries[r, ..., K:]
    return state.unsqueeze(0), token


def _triton(q, k, v, g, beta, scale, cp: CPContext, initial_state, output_final_state, incoming, anchors):
    from gdn_kernels.gated_delta_rule import triton_gated_delta_rule

    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    starting = (torch.zeros(cp.docs_starting_here, HV, K, V, dtype=torch.float32, device=v.device)
                if initial_state is None else initial_state.float())
    token = None
    if cp.algorithm == "allgather":
        state_in, token = _allgather_incoming_state_triton(k, v, g, beta, cp, starting)
    else:
        state_in = incoming.wait(*anchors) if incoming is not None else None
    states = starting if state_in is None else torch.cat([state_in.float(), starting])
    o, final = triton_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=states,
                                       output_final_state=True, cu_seqlens=cp.local_cu_list)
    if cp.continues_to_next and cp.algorithm == "relay":
        token = send_to_next(cp, final[-1:])
    o = tie(o, token)
    return o, (final[:cp.docs_ending_here] if output_final_state else None)


SUMMARY_SPANS = 16  # spans of the allgather summary run side by side; their pairs fold in a loop


def _allgather_incoming_state_triton(k, v, g, beta, cp: CPContext, starting):
    from gdn_kernels.gated_delta_rule import CHUNK, triton_gated_delta_rule

    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    piece_start = cp.local_cu_list[-2]
    piece = [x[:, piece_start:] for x in (k, v, g, beta)]
    length = piece[0].shape[1]
    span = -(-max(1, -(-length // SUMMARY_SPANS)) // CHUNK) * CHUNK      # chunk-aligned span length
    bounds = list(range(0, length, span)) + [length]      # host list: no device sync
    n_spans = len(bounds) - 1
    # Affine in the state: starting from [I | 0] with values [0 | V], a span ends in [M | S_loc].
    values = torch.cat([piece[1].new_zeros(*piece[1].shape[:3], K), piece[1]], dim=-1)
    eye = torch.eye(K, device=v.device).expand(n_spans, HV, K, K)
    start = torch.cat([eye, eye.new_zeros(n_spans, HV, K, V)], dim=-1)
    _, ends = triton_gated_delta_rule(torch.zeros_like(piece[0]), piece[0], values, piece[2], piece[3],
                                      scale=1.0, initial_state=start, output_final_state=True,
                                      cu_seqlens=bounds)
    m_last, s_last = ends[0, ..., :K], ends[0, ..., K:]
    for i in range(1, n_spans):
        m_last, s_last = ends[i, ..., :K] @ m_last, ends[i, ..., :K] @ s_last + ends[i, ..., K:]
    m_last, s_last = m_last.unsqueeze(0), s_last.unsqueeze(0)
    return _gather_and_fold(m_last, s_last, cp, starting)
