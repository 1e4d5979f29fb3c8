"""Causal softmax attention (sliding window or full, grouped-query heads, packed documents): the
public op. Single-device forms and the oracle in masked.py, the context-parallel form in cp.py."""
from __future__ import annotations

import torch

from ...comm import CPContext
from .cp import cp_attention
from .masked import attention_reference, check_cp_call, masked_attention, row_attention

__all__ = ["attention", "masked_attention", "attention_reference"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              window: int | None = None, cu_seqlens: torch.Tensor | None = None,
              scale: float | None = None, impl: str = "auto", cp: CPContext | None = None,
              memo: dict | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention over a row, q/k/v of the same length T.

    q [B, T, H, D], k [B, T, HKV, D], v [B, T, HKV, Dv] -> [B, T, H, Dv]. `window` is the number
    of keys a query sees, itself included (None: full causal). With `cu_seqlens` (batch 1) the
    documents of the packed row do not see each other. Only causal=True is supported.

    With `cp` (the row's context-parallel plan, which holds the global document boundaries: give no
    `cu_seqlens`) the tensors are this rank's shard of one packed row: a sliding window takes a halo
    of window-1 keys and values from the previous rank(s); full attention all-gathers K and V, and
    computes either the shard's queries or, with the plan's attention_split "zigzag", two balanced
    query blocks of the row whose outputs return to their shards (docs/design.md §2).

    `memo`: a dict kept for one row (SequenceInfo.memo), or for one rank's shard of it: the row's
    document ids and block masks are built by the first call and reused by later ones on it.
    """
    if cp is None:
        return row_attention(q, k, v, causal=causal, window=window, cu_seqlens=cu_seqlens, scale=scale,
                             impl=impl, memo=memo)
    check_cp_call(q, k, v, causal, window)
    _check_plan(cp, cu_seqlens, q)
    return cp_attention(q, k, v, window=window, scale=scale, impl=impl, cp=cp, memo=memo)


def _check_plan(cp: CPContext, cu_seqlens, x: torch.Tensor) -> None:
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens and cp exclude each other: the context-parallel plan holds the row's "
                         "global document boundaries (CPContext.build(group, cu_seqlens, local_len))")
    if x.shape[1] != cp.local_len:
        raise ValueError(f"the local tensors have {x.shape[1]} tokens but the CP plan has {cp.local_len} "
                         f"per rank")
