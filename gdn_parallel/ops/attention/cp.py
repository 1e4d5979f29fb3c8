"""Attention on a CP shard.

Sliding window: the previous window-1 keys and values (after RoPE) of the same document arrive as
a halo from as many previous ranks as needed; their gradients go back. Flows forward only, so it
keeps the relay's wavefront. The keys always have the same length: the halo sits in a fixed number
of slots before the shard's own keys, and slots it does not fill hold keys of no document.
Full causal attention all-gathers K and V (lockstep). Which queries a rank computes is the plan's
`attention_split` (parallel.cp_attention_split): "contiguous", its own shard (the last rank does
the most work: (2r + 1) / n² of the row at rank r of n), or "zigzag" (comm/zigzag.py), the row cut
into 2n query blocks and rank r computing blocks r and 2n - 1 - r, equal work on every rank: the
query blocks go to the ranks that compute them and the outputs come back (one all-to-all each,
their gradients the other way in the backward), the mask keeping their global indices and
documents. The shards themselves stay contiguous. Blocks of a multiple of 128 tokens keep
FlexAttention's query tiles inside one block (a tile over both is only called partial more often).
"""
from __future__ import annotations

import torch
from gdn_kernels.host_index import on_device

from ...comm.context import CPContext
from ...comm.halo import exchange_halo
from ...comm.p2p import all_gather, tie
from ...comm.zigzag import to_owners, to_workers, worked_positions
from ...config import CP_ATTENTION_SPLITS
from .block_mask import BLOCK
from .masked import masked_attention


def cp_attention(q, k, v, *, window: int | None, scale, impl: str, cp: CPContext,
                 memo: dict | None = None) -> torch.Tensor:
    """`memo`: the row's (SequenceInfo.memo), where the block mask of the shard's geometry is kept."""
    if q.shape[0] != 1:
        raise ValueError(f"context parallelism takes one packed row (batch 1), got batch {q.shape[0]}")
    if cp.attention_split not in CP_ATTENTION_SPLITS:
        raise ValueError(f"the CP plan's attention_split {cp.attention_split!r} is not one of "
                         f"{CP_ATTENTION_SPLITS} (parallel.cp_attention_split)")
    if window is None and cp.attention_split == "zigzag":
        return _zigzag_attention(q, k, v, scale, impl, cp, memo)
    device = q.device
    q_index, q_doc = _shard_queries(cp, device)
    token = None
    if window is None:
        kv = _whole_row(cp, k, v)
        k_index, k_doc = _row_key_positions(cp, device)
    else:
        kv_local = torch.cat([k, v], dim=-1)
        halo, token = exchange_halo(cp, kv_local, window - 1, q)
        kv, k_index, k_doc = _fixed_halo_keys(cp, kv_local, halo, window - 1, q_doc)
    k_ext, v_ext = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    o = masked_attention(q, k_ext, v_ext, q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc,
                         window=window, scale=scale, impl=impl, memo=memo)
    return tie(o, token)


def full_attention_positions(cp: CPContext, device) -> tuple[torch.Tensor, ...]:
    """(q_index, q_doc, k_index, k_doc): the mask of full causal attention on this rank under the
    plan's split, the global indices and documents of the queries it computes (its shard, or its two
    zigzag blocks) and of the whole row's keys. Needs no message, so one process can lay out every
    rank's work (tools/bench_cp_attention.py --ranks)."""
    k_index, k_doc = _row_key_positions(cp, device)
    if cp.attention_split == "zigzag":
        q_index = on_device(worked_positions(cp), device)
        return q_index, k_doc[q_index], k_index, k_doc
    return *_shard_queries(cp, device), k_index, k_doc


def _shard_queries(cp: CPContext, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Global indices and documents of the shard's own tokens."""
    return torch.arange(cp.start, cp.end, device=device), cp.local_doc_ids().to(device)


def _row_key_positions(cp: CPContext, device) -> tuple[torch.Tensor, torch.Tensor]:
    k_index = torch.arange(cp.total, device=device)
    return k_index, torch.bucketize(k_index, on_device(cp.global_cu_seqlens, device), right=True) - 1


def _whole_row(cp: CPContext, k, v) -> torch.Tensor:
    """K and V of the whole row, all-gathered: [1, total, HKV, Dk + Dv]."""
    k_all = all_gather(cp, torch.cat([k[0], v[0]], dim=-1))           # [P, L, HKV, Dk + Dv]
    return k_all.reshape(1, cp.total, *k_all.shape[2:])


def _zigzag_attention(q, k, v, scale, impl: str, cp: CPContext, memo: dict | None) -> torch.Tensor:
    """Full attention of the query blocks this rank computes under the zigzag split (their global
    indices and documents in the mask), the outputs returned to the shards that own them."""
    # first: worked_positions refuses an odd shard before any message
    q_index, q_doc, k_index, k_doc = full_attention_positions(cp, q.device)
    kv = _whole_row(cp, k, v)
    worked_q = to_workers(cp, q[0]).unsqueeze(0)
    k_ext, v_ext = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    o = masked_attention(worked_q, k_ext, v_ext, q_index=q_index, k_index=k_index, q_doc=q_doc,
                         k_doc=k_doc, window=None, scale=scale, impl=impl, memo=memo)
    return to_owners(cp, o[0]).unsqueeze(0)


def _fixed_halo_keys(cp: CPContext, kv_local: torch.Tensor, halo: torch.Tensor | None, width: int,
                     q_doc: torch.Tensor):
    """Keys [halo slots | the shard's own] with their global indices and documents. The received halo
    is as long as the document reaching over the boundary allows (0 at a document start, at rank 0),
    so its length changes from row to row; the compiled FlexAttention would compile again for every
    new key length (a step 2-4x the others, at random). Instead the halo fills the last of
    `width` rounded up to whole key tiles, and the free slots hold zero keys of document -1, which
    no query attends; whole tiles also keep the shard's own keys aligned with the query tiles."""
    slots = -(-width // BLOCK) * BLOCK
    h = 0 if halo is None else halo.shape[1]
    free = kv_local.new_zeros(kv_local.shape[0], slots - h, *kv_local.shape[2:])
    kv = torch.cat([free, kv_local] if halo is None else [free, halo, kv_local], dim=1)
    device = kv_local.device
    k_index = torch.arange(cp.start - slots, cp.end, device=device)
    k_doc = torch.cat([torch.full((slots - h,), -1, dtype=q_doc.dtype, device=device),
                       torch.full((h,), cp.doc_of(cp.start), dtype=q_doc.dtype, device=device), q_doc])
    return kv, k_index, k_doc
