"""Summarise a token segment as an affine map of its incoming state: S_out = M S_in + S_loc.

The gated delta rule is affine in the state, so each chunk is a pair (M_c, S_c) with
M_c = exp(gamma_C) I - (K o exp(gamma_C - gamma))^T W and S_c = (K o exp(gamma_C - gamma))^T U, and
pairs compose associatively: (M2, S2) o (M1, S1) = (M2 M1, M2 S1 + S2). The chunk pairs are computed
all at once and folded pairwise in log2(chunks) rounds (docs/design.md §2, the allgather algorithm).
"""
from __future__ import annotations

import torch


def compose(later: tuple, earlier: tuple) -> tuple:
    """(M2, S2) o (M1, S1): first apply the earlier segment, then the later one."""
    m2, s2 = later
    m1, s1 = earlier
    return m2 @ m1, m2 @ s1 + s2


def fold_chunk_transitions(m: torch.Tensor, s: torch.Tensor, layout) -> tuple:
    """Per-chunk pairs [n, HV, K, *] -> per-document pairs [N, HV, K, *] by a pairwise tree."""
    HV, K, V = s.shape[1], s.shape[2], s.shape[3]
    N, width = layout.num_docs, max(layout.max_chunks, 1)
    # Documents side by side, padded at their end with the identity pair (I, 0).
    slot = torch.cat([torch.arange(n) + d * width
                      for d, n in enumerate(layout.doc_num_chunks)]).to(m.device)
    eye = torch.eye(K, dtype=m.dtype, device=m.device).expand(N * width, HV, K, K)
    ms = eye.index_copy(0, slot, m).reshape(N, width, HV, K, K)
    ss = s.new_zeros(N * width, HV, K, V).index_copy(0, slot, s).reshape(N, width, HV, K, V)
    while ms.shape[1] > 1:
        if ms.shape[1] % 2:
            ms = torch.cat([ms, torch.eye(K, dtype=m.dtype, device=m.device).expand(N, 1, HV, K, K)], 1)
            ss = torch.cat([ss, ss.new_zeros(N, 1, HV, K, V)], 1)
        ms, ss = compose((ms[:, 1::2], ss[:, 1::2]), (ms[:, 0::2], ss[:, 0::2]))
    return ms[:, 0], ss[:, 0]
