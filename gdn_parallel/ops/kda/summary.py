"""Summarise a token segment of Kimi Delta Attention as an affine map of its incoming state:
S_out = M S_in + S_loc (docs/design.md §2, the allgather algorithm).

As for the gated delta rule (gated_delta_rule/summary.py), each chunk is a pair (M_c, S_c), now with
M_c = Diag(exp(G_C)) - (K o exp(G_C - G))^T W and S_c = (K o exp(G_C - G))^T U. The pairs have the
same shapes ([K, K] and [K, V] per head) and compose the same way, so the gated delta rule's
`compose` and `fold_chunk_transitions` serve both ops.
"""
from __future__ import annotations

import torch
from gdn_kernels.chunk_layout import ChunkLayout

from ..gated_delta_rule.summary import compose, fold_chunk_transitions
from .chunk import chunk_factors

__all__ = ["compose", "fold_chunk_transitions", "document_summaries", "apply_summary"]


def document_summaries(k, v, g, beta, layout: ChunkLayout) -> tuple:
    """Flat packed inputs [total, HV, *] (k expanded to HV heads; g [total, HV, K]) in the compute
    dtype. Returns (M [N, HV, K, K], S_loc [N, HV, K, V]) per document of the layout: every chunk's
    pair at once, then a log-depth pairwise fold."""
    k_c, v_c, g_c, beta_c = (layout.pad(x) for x in (k, v, g, beta))
    factors = chunk_factors(None, k_c, v_c, g_c, beta_c, scale=1.0)
    m, s = factors.transition(slice(None))
    return fold_chunk_transitions(m, s, layout)


def apply_summary(m: torch.Tensor, s_loc: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """The state after the segment, M S_in + S_loc ([N, HV, K, V])."""
    return m @ state_in.to(m.dtype) + s_loc
