"""FlexAttention's block mask for the one mask rule of masked.py, built from per-block bounds.

A tile of BLOCK query rows x BLOCK key columns is
  - empty when no pair in it can pass: the documents of the two blocks do not overlap, or every key
    lies after every query, or every key lies `window` or more before every query;
  - full when every pair passes: both blocks hold one and the same document and every distance
    q_index - k_index is in [0, window);
  - partial otherwise, and then the kernel evaluates the mask rule element by element.
The bounds (min and max of index and document id over a block) hold for every pair in the tile, so
the classes are exact for empty and full and conservative only in calling some tiles partial.
Padding rows of a last, short block make that block partial, never full.

Building the mask this way costs O(blocks^2) small tensor ops and no compilation; torch.compile of
`create_block_mask` cost most of the first step's three minutes on an H200 (cold cache).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # FlexAttention's default tile on both axes
_FAR = 1 << 62  # padding that no index or document id reaches


def _bounds(x: torch.Tensor):
    """(min, max, is_whole) per BLOCK-long piece of a 1-D integer tensor."""
    n = -(-x.shape[0] // BLOCK)
    pad = n * BLOCK - x.shape[0]
    low = F.pad(x, (0, pad), value=_FAR).view(n, BLOCK).amin(1)
    high = F.pad(x, (0, pad), value=-_FAR).view(n, BLOCK).amax(1)
    whole = torch.ones(n, dtype=torch.bool, device=x.device)
    if pad:
        whole[-1] = False
    return low, high, whole


def _listed(tiles: torch.Tensor):
    """(count [1, 1, nq], indices [1, 1, nq, nk]) of the True tiles of each query block, those first."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def tile_classes(q_index, k_index, q_doc, k_doc, window: int | None):
    """Boolean [nq, nk] tiles (partial, full) for the mask rule."""
    qi_lo, qi_hi, q_whole = _bounds(q_index)
    ki_lo, ki_hi, k_whole = _bounds(k_index)
    qd_lo, qd_hi, _ = _bounds(q_doc)
    kd_lo, kd_hi, _ = _bounds(k_doc)
    longest = qi_hi[:, None] - ki_lo[None]     # the largest q_index - k_index in the tile
    shortest = qi_lo[:, None] - ki_hi[None]    # the smallest
    docs_meet = (qd_lo[:, None] <= kd_hi[None]) & (kd_lo[None] <= qd_hi[:, None])
    some = docs_meet & (longest >= 0)
    every = (qd_lo == qd_hi)[:, None] & (kd_lo == kd_hi)[None] & (qd_lo[:, None] == kd_lo[None]) \
        & (shortest >= 0) & q_whole[:, None] & k_whole[None]
    if window is not None:
        some = some & (shortest < window)
        every = every & (longest < window)
    return some & ~every, every


def block_mask(mask_mod, q_index, k_index, q_doc, k_doc, window: int | None) -> BlockMask:
    """The BlockMask of the rule for queries q_* [Tq] and keys k_* [Tk] (one for every batch row and head)."""
    partial, full = tile_classes(q_index, k_index, q_doc, k_doc, window)
    count, indices = _listed(partial)
    full_count, full_indices = _listed(full)
    return BlockMask.from_kv_blocks(count, indices, full_count, full_indices, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(q_index.shape[0], k_index.shape[0]))
