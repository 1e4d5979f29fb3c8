"""The fixed batch every layout and the reference train on: documents that cross every boundary.

A step is `micro_batches` packed rows of `rows x seq_len` tokens (the trainer's micro-batches of
train.microbatch_size rows, concatenated into one row with `cu_seqlens`). Their documents are laid
out so that the parallel code meets every case it handles: one document over the whole row (the
GDN state and the conv / window halos cross every CP shard boundary and the row boundary at
seq_len), pieces of one and two tokens next to a shard boundary, documents ending exactly on shard
boundaries (a hand-over of a zero state), and seeded random cuts. Tokens are seeded random ids.

Data-parallel replica d of a layout trains on micro-batches d, d + dp, d + 2 dp, ... (the trainer's
global stream is cut the same way); the reference trains on all of them. The step's loss is the sum
of every token loss over the label count of the whole step in both, so they are the same function.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..data.packing import PackedBatch, random_packed_row

LAYOUT_KINDS = 4    # how many document layouts the micro-batches cycle through
MIN_ROW_TOKENS = 16  # room for every layout's pieces (a 1-token and a 2-token piece past the middle)


def document_boundaries(total: int, kind: int, seed: int) -> list[int]:
    """cu_seqlens of a row of `total` tokens, for document layout `kind` (0..LAYOUT_KINDS-1)."""
    if total < MIN_ROW_TOKENS:
        raise ValueError(f"a verification row needs at least {MIN_ROW_TOKENS} tokens, got {total}: "
                         f"raise --seq-len or --rows")
    kind %= LAYOUT_KINDS
    if kind == 0:      # one document: everything crosses every boundary
        cuts = []
    elif kind == 1:
        # tools/verify_cp.py's documents: pieces of 2 and 1 tokens past the middle, then the end
        cuts = [total // 5, total // 2 + 7, total // 2 + 9, total - 1]
    elif kind == 2:    # ends exactly on the shard boundaries of cp = 2 and 4, one token past those of cp = 8
        cuts = [total // 4, total // 2, 3 * total // 4, total // 8 + 1, 5 * total // 8 + 1]
    else:              # random cuts
        generator = torch.Generator().manual_seed(seed)
        cuts = torch.randint(1, total, (3,), generator=generator).tolist()
    return [0, *sorted({c for c in cuts if 0 < c < total}), total]


def verification_batch(step: int, micro_batches: int, rows: int, seq_len: int, vocab_size: int,
                       device: torch.device) -> list[PackedBatch]:
    """The step's micro-batches (the same on every rank), on `device`."""
    total = rows * seq_len
    batch = []
    for m in range(micro_batches):
        seed = 1000 * step + m
        cu_seqlens = document_boundaries(total, kind=step + m, seed=seed)
        batch.append(random_packed_row(cu_seqlens, vocab_size, seed).to(device))
    return batch


def replica_share(batch: Sequence[PackedBatch], dp_rank: int, dp: int) -> list[PackedBatch]:
    """Data-parallel replica `dp_rank`'s micro-batches of the step."""
    if len(batch) % dp:
        raise ValueError(f"{len(batch)} micro-batches do not split over dp={dp} replicas")
    return list(batch[dp_rank::dp])
