"""Kimi Delta Attention on a contiguous shard of a longer sequence (docs/design.md §2): the gated delta
rule's context-parallel paths with KDA's chunk form or kernels. The state is [K, V] per head and a
segment's summary a [K, K] transition with a [K, V] contribution, as there, so the relay's hand-over,
the summary all-gather and its fold, and the hand-over between recompute chunks of one process are the
same code; only the chunk factors carry a decay per key channel.

PyTorch (`cp_kimi_delta_attention`): the gated delta rule's `cp_chunked` with KDA's chunk form.
Triton (`cp_kimi_delta_attention_triton`): the relay hands the kernels a StateRelay, as GDN's: they
receive the incoming state after their state-independent chunk work and send the final state after
their walk, before the outputs (backward: the gradient's receive before the walk, its send right
after). The all-gather runs them once on values widened by K columns (`allgather_by_linearity`),
which needs V + K <= the kernels' widest head (wider heads take the PyTorch form).
"""
from __future__ import annotations

import torch

from ...comm.context import CPContext
from ...comm.p2p import StateRelay, send_to_next, tie
from ..gated_delta_rule.cp import (
    allgather_by_linearity,
    check_shard,
    cp_chunked,
    gather_and_fold,
    post_incoming_state,
)
from ..triton_dispatch import imported_kernel
from .chunk import KIMI_DELTA_ATTENTION


def cp_kimi_delta_attention(q, k, v, g, beta, *, scale: float, cp: CPContext, chunk_size: int,
                            initial_state: torch.Tensor | None, output_final_state: bool):
    """q, k: [1, L, HV, K] normalised and expanded to the value heads; v [1, L, HV, V]; g (log decay,
    activated) [1, L, HV, K]; beta [1, L, HV] (this rank's shard). initial_state: [docs starting on this
    rank, HV, K, V] or None. Returns (o [1, L, HV, V], final states of the documents that end on this
    rank or None)."""
    return cp_chunked(KIMI_DELTA_ATTENTION, q, k, v, g, beta, scale=scale, cp=cp, chunk_size=chunk_size,
                      initial_state=initial_state, output_final_state=output_final_state)


def triton_takes_cp(k, v, cp: CPContext) -> bool:
    """Whether the kernels can run this shard: the all-gather's widened values must fit their heads."""
    widest = imported_kernel("kda").MAX_HEAD_DIM
    return cp.algorithm == "relay" or not cp.continues_from_prev or k.shape[-1] + v.shape[-1] <= widest


def cp_kimi_delta_attention_triton(q, k, v, g, beta, *, scale: float, cp: CPContext,
                                   initial_state: torch.Tensor | None, output_final_state: bool):
    """As cp_kimi_delta_attention on the kernels: q, k [1, L, H, K] normalised, grouped heads read in
    place (value head j reads head j // (HV // H)); the rest as there."""
    check_shard(q, initial_state, cp)
    kernels = imported_kernel("kda")
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    starting = (torch.zeros(cp.docs_starting_here, HV, K, V, dtype=torch.float32, device=v.device)
                if initial_state is None else initial_state.float())

    def run(values, states, relay=None):
        return kernels.triton_kimi_delta_attention(q, k, values, g, beta, scale=scale, initial_state=states,
                                                   output_final_state=True, cu_seqlens=cp.local_cu_list,
                                                   relay=relay)

    if cp.algorithm == "allgather":
        if cp.continues_from_prev:
            return allgather_by_linearity(run, k, v, cp, starting, output_final_state)
        o, final = run(v, starting)  # every document starts here: the last one's summary is its final state
        _, token = gather_and_fold(final.new_zeros(1, HV, K, K), final[-1:], cp)
        return tie(o, token), (final[:cp.docs_ending_here] if output_final_state else None)
    incoming = post_incoming_state(cp, k, v)
    relay = StateRelay(cp, incoming)
    if incoming is not None and incoming.local:
        # from a chunk of this process: the state goes in as an input, its gradient through autograd
        starting = torch.cat([incoming.wait().float(), starting])
    o, final = run(v, starting, relay if relay.receives or relay.sends else None)
    if cp.continues_to_next and cp.next_is_local:   # to a chunk of this process: the state itself
        send_to_next(cp, final[-1:])
    return o, (final[:cp.docs_ending_here] if output_final_state else None)
