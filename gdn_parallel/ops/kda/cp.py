"""Kimi Delta Attention on a contiguous shard of a longer sequence (docs/design.md §2): the gated delta
rule's context-parallel path (gated_delta_rule/cp.py, `cp_chunked`) with KDA's chunk form. The state
is [K, V] per head and a segment's summary a [K, K] transition with a [K, V] contribution, as there, so
the relay's hand-over, the summary all-gather and its fold, and the hand-over between recompute chunks
of one process are the same code; only the chunk factors carry a decay per key channel."""
from __future__ import annotations

import torch

from ...comm.context import CPContext
from ..gated_delta_rule.cp import cp_chunked
from .chunk import KIMI_DELTA_ATTENTION


def cp_kimi_delta_attention(q, k, v, g, beta, *, scale: float, cp: CPContext, chunk_size: int,
                            initial_state: torch.Tensor | None, output_final_state: bool):
    """q, k: [1, L, HV, K] normalised and expanded to the value heads; v [1, L, HV, V]; g (log decay,
    activated) [1, L, HV, K]; beta [1, L, HV] (this rank's shard). initial_state: [docs starting on this
    rank, HV, K, V] or None. Returns (o [1, L, HV, V], final states of the documents that end on this
    rank or None)."""
    return cp_chunked(KIMI_DELTA_ATTENTION, q, k, v, g, beta, scale=scale, cp=cp, chunk_size=chunk_size,
                      initial_state=initial_state, output_final_state=output_final_state)
