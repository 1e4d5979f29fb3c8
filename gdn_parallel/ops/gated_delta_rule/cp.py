"""Gated delta rule on a contiguous shard of a longer sequence (docs/design.md §2).

relay: post the receive of the incoming state, compute everything that does not need it (the
chunk factors), wait, run the inter-chunk recurrence, send the final state to rank r + 1 at once,
then compute the outputs. Backward mirrors it through p2p's autograd wiring. Between sequence
chunks of one process (chunked recomputation) the state is handed over as a tensor, in autograd.

allgather: summarise the shard's last document piece as (M, S_loc), all-gather the summaries, fold
the prefix into the incoming state, then run the local recurrence from it. Autograd through the
all-gather and the fold gives the mirrored backward (M^T chain).

impl="triton" runs the local work with the fused kernels (gdn_kernels.gated_delta_rule). The relay
gives them a StateRelay: they receive the state after their chunk factors, send the final state
after the walk and before the outputs, and in the backward send the state gradient right after the
backward walk. The allgather runs the kernels once, on values widened by K zero columns, so that
the same run yields the summary and the outputs up to a correction linear in the incoming state
(_triton_allgather_continuing): no second pass after the all-gather.

The PyTorch path (`cp_chunked`) takes the chunk form as data (`ChunkRule`): Kimi Delta Attention
(ops/kda/cp.py), whose state and segment summaries have the same shapes, runs through it too.
"""
from __future__ import annotations

import torch
from gdn_kernels.chunk_layout import build_layout

from ...comm.context import CPContext, sequence_lengths
from ...comm.p2p import StateRelay, all_gather, post_recv_from_prev, send_to_next, tie
from ...config import CP_ALGORITHMS
from ..triton_dispatch import imported_kernel
from .chunk import GATED_DELTA_RULE, ChunkRule, ChunkTransitions, chunk_recurrence
from .summary import fold_chunk_transitions


def check_cp_call(q, cu_seqlens, cp: CPContext, impl: str) -> None:
    """The arguments of a delta rule's call with a CP plan: the chunk algorithm on this rank's shard of
    one packed row, whose documents the plan holds."""
    if impl == "naive":
        raise ValueError("impl='naive' is the single-process oracle; context parallelism runs the chunk "
                         "algorithm (impl='chunk' or 'auto')")
    if q.shape[0] != 1:
        raise ValueError(f"context parallelism takes one packed row: q has batch {q.shape[0]}; flatten the "
                         f"batch into [1, total] and describe it with the global cu_seqlens")
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens and cp exclude each other: the context-parallel plan holds the row's "
                         "global document boundaries (CPContext.build(group, cu_seqlens, local_len))")
    if q.shape[1] != cp.local_len:
        raise ValueError(f"the local tensors have {q.shape[1]} tokens but the CP plan has {cp.local_len} "
                         f"per rank")
    if cp.algorithm not in CP_ALGORITHMS:
        raise ValueError(f"the CP plan's algorithm {cp.algorithm!r} is not one of {CP_ALGORITHMS}")


def cp_gated_delta_rule(q, k, v, g, beta, *, scale: float, cp: CPContext, chunk_size: int,
                        initial_state: torch.Tensor | None, output_final_state: bool, impl: str = "chunk",
                        decay_params=None, beta_activation=None, use_qk_l2norm=False):
    """q, k: [1, L, HV, K] expanded to the value heads (impl "triton": [1, L, H, K], grouped heads are read
    in place); v [1, L, HV, V]; g, beta [1, L, HV] (this rank's shard).

    initial_state: [docs starting on this rank, HV, K, V] or None. Returns (o [1, L, HV, V],
    final states of the documents that end on this rank or None). decay_params, beta_activation and
    use_qk_l2norm (see gated_delta_rule) only with impl="triton", whose kernels apply them.
    """
    if impl != "triton" and (decay_params is not None or beta_activation is not None or use_qk_l2norm):
        raise ValueError("cp_gated_delta_rule applies decay_params/beta_activation/use_qk_l2norm only with "
                         "impl='triton'; apply them first (ops.gated_delta_rule.gates.activate_gates, "
                         "l2_normalize)")
    if impl != "triton":
        return cp_chunked(GATED_DELTA_RULE, q, k, v, g, beta, scale=scale, cp=cp, chunk_size=chunk_size,
                          initial_state=initial_state, output_final_state=output_final_state)
    check_shard(q, initial_state, cp)
    incoming = post_incoming_state(cp, k, v)
    gates = dict(decay_params=decay_params, beta_activation=beta_activation, use_qk_l2norm=use_qk_l2norm)
    return _triton(q, k, v, g, beta, scale, cp, initial_state, output_final_state, incoming, gates)


def check_shard(q, initial_state, cp: CPContext) -> None:
    if q.shape[0] != 1:
        raise ValueError(f"context parallelism takes one packed row (batch 1), got batch {q.shape[0]}")
    if initial_state is not None and initial_state.shape[0] != cp.docs_starting_here:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states but {cp.docs_starting_here} "
                         f"documents start on CP rank {cp.rank}: give states only for those")


def post_incoming_state(cp: CPContext, k, v):
    """The relay's receive of the state [1, HV, K, V] from the previous piece, posted before the local
    work it overlaps."""
    if not (cp.continues_from_prev and cp.algorithm == "relay"):
        return None
    shape = (1, v.shape[2], k.shape[-1], v.shape[-1])
    return post_recv_from_prev(cp, shape, torch.promote_types(v.dtype, torch.float32), v.device)


def cp_chunked(rule: ChunkRule, q, k, v, g, beta, *, scale: float, cp: CPContext, chunk_size: int,
               initial_state: torch.Tensor | None, output_final_state: bool):
    """A delta rule's PyTorch chunk form on this rank's shard (module docstring): q, k [1, L, HV, K]
    expanded to the value heads, v [1, L, HV, V], g and beta as `rule` takes them, activated.
    initial_state: [docs starting on this rank, HV, K, V] or None. Returns (o [1, L, HV, V], final
    states of the documents that end on this rank or None)."""
    check_shard(q, initial_state, cp)
    dtype = torch.promote_types(v.dtype, torch.float32)
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    anchors = tuple(x for x in (q, k, v, g, beta, initial_state) if x is not None)
    incoming = post_incoming_state(cp, k, v)

    layout = build_layout(sequence_lengths(cp.local_cu_list), chunk_size, v.device)
    q_c, k_c, v_c, g_c, beta_c = (layout.pad(x[0].to(dtype)) for x in (q, k, v, g, beta))
    factors = rule.factors(q_c, k_c, v_c, g_c, beta_c, scale)
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
    o = layout.unpad(rule.outputs(factors, chunk_states)).to(v.dtype).unsqueeze(0)
    o = tie(o, token)
    final_out = final[:cp.docs_ending_here] if output_final_state else None
    return o, final_out


def _allgather_incoming_state(factors: ChunkTransitions, layout, cp: CPContext, starting):
    """Fold every earlier rank's summary of its last piece into this rank's incoming state. The
    summaries are composed in the state's dtype, autocast or not (docs/design.md §2): the all-gather
    also needs one dtype on every rank, and only some ranks run the product below."""
    with torch.autocast(starting.device.type, enabled=False):
        return _allgather_incoming_state_fp32(factors, layout, cp, starting)


def _allgather_incoming_state_fp32(factors: ChunkTransitions, layout, cp: CPContext, starting):
    last = layout.num_docs - 1
    first_chunk, n_chunks = layout.doc_first_chunk[last], layout.doc_num_chunks[last]
    m, s = factors.transition(slice(first_chunk, first_chunk + n_chunks))
    piece_layout = type(layout)(layout.chunk_size, 1, n_chunks * layout.chunk_size, layout.token_dest,
                                layout.chunk_rows[first_chunk:first_chunk + n_chunks], [0], [n_chunks],
                                [layout.doc_lengths[last]])
    m_last, s_last = fold_chunk_transitions(m, s, piece_layout)
    if not (cp.continues_from_prev and cp.num_local_docs == 1):
        # The last piece starts on this rank: its outgoing state does not depend on earlier ranks.
        s_last = m_last @ starting[-1:].to(m_last.dtype) + s_last
        m_last = torch.zeros_like(m_last)
    return gather_and_fold(m_last, s_last, cp)


def gather_and_fold(m_last, s_last, cp: CPContext):
    """All-gather every rank's (M, S_loc) of its last piece; fold the earlier ranks' into this rank's
    incoming state. Returns (state or None, a zero token tying the all-gather into autograd)."""
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


def _triton(q, k, v, g, beta, scale, cp: CPContext, initial_state, output_final_state, incoming, gates):
    triton_gated_delta_rule = imported_kernel("gated_delta_rule").triton_gated_delta_rule
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    starting = (torch.zeros(cp.docs_starting_here, HV, K, V, dtype=torch.float32, device=v.device)
                if initial_state is None else initial_state.float())
    if cp.algorithm == "allgather" and cp.continues_from_prev:
        return _triton_allgather_continuing(q, k, v, g, beta, scale, cp, starting, output_final_state, gates)
    relay = StateRelay(cp, incoming) if cp.algorithm == "relay" else None
    if incoming is not None and incoming.local:
        # from a chunk of this process: the state goes in as an input, its gradient through autograd
        starting = torch.cat([incoming.wait().float(), starting])
    if relay is not None and not (relay.receives or relay.sends):
        relay = None
    o, final = triton_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=starting,
                                       output_final_state=True, cu_seqlens=cp.local_cu_list, relay=relay,
                                       **gates)
    if cp.continues_to_next and cp.next_is_local:   # to a chunk of this process: the state itself
        send_to_next(cp, final[-1:])
    if cp.algorithm == "allgather":  # every document starts here: the last one's summary is its final state
        _, token = gather_and_fold(final.new_zeros(1, HV, K, K), final[-1:], cp)
        o = tie(o, token)
    return o, (final[:cp.docs_ending_here] if output_final_state else None)


def _triton_allgather_continuing(q, k, v, g, beta, scale, cp: CPContext, starting, output_final_state, gates):
    triton_gated_delta_rule = imported_kernel("gated_delta_rule").triton_gated_delta_rule

    def run(values, initial_state):
        return triton_gated_delta_rule(q, k, values, g, beta, scale=scale, initial_state=initial_state,
                                       output_final_state=True, cu_seqlens=cp.local_cu_list, **gates)
    return allgather_by_linearity(run, k, v, cp, starting, output_final_state)


def allgather_by_linearity(run, k, v, cp: CPContext, starting, output_final_state: bool):
    """The summary all-gather for a rank whose first document continues from earlier ranks, with one run
    of an opaque kernel `run(values [1, L, HV, V'], initial_state [N, HV, K, V']) -> (o, final)`.

    One run gives both this rank's summary and its outputs before the incoming state is known, by
    linearity in that state: the first document starts from [0 | I] with values [V | 0], so its outputs
    come out as [o from a zero state | Q~] and its final state as [S_loc | M]; with the incoming state
    S_in, o = o_zero + Q~ S_in and the final state is S_loc + M S_in."""
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    values = torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=-1)
    eye = torch.eye(K, device=v.device).expand(1, HV, K, K)
    first_start = torch.cat([eye.new_zeros(1, HV, K, V), eye], dim=-1)
    starts = torch.cat([first_start, torch.cat([starting, starting.new_zeros(*starting.shape[:3], K)], -1)])
    o_ext, final_ext = run(values, starts)
    s_last = final_ext[-1:, ..., :V]
    m_last = final_ext[-1:, ..., V:] if cp.num_local_docs == 1 else torch.zeros_like(final_ext[-1:, ..., V:])
    state_in, token = gather_and_fold(m_last, s_last, cp)
    # Q~ is zero past the first document (the later ones start from [S0 | 0]), so one batched product
    # over all rows is exact; in the kernels' dtype, as their chunk states are.
    q_tilde = o_ext[0, :, :, V:].transpose(0, 1)                              # [HV, L, K], a view
    correction = torch.bmm(q_tilde, state_in[0].to(q_tilde.dtype)).transpose(0, 1).unsqueeze(0)
    o = o_ext[..., :V] + correction
    final = torch.cat([final_ext[:1, ..., :V] + final_ext[:1, ..., V:] @ state_in, final_ext[1:, ..., :V]])
    return tie(o, token), (final[:cp.docs_ending_here] if output_final_state else None)
