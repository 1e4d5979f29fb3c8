"""The validation set: the same rows under every layout.

The set is the first `rows` rows of `seq_len` tokens of the validation split's stream (its first
epoch, in the seeded order of data/stream.py), capped at the split's size. Evaluating it goes the
way training goes: each evaluation step is a global batch of `dp_size` replicas x `micro_batches`
micro-batches of `rows_per_micro_batch` rows, replica r taking its share of every global micro-batch
(the stream's sharding rule). The last step is filled up with the stream's next tokens whose labels
are all ignored, so every replica (and every pipeline stage) runs the same number of forwards of the
same shape, and the labelled tokens are exactly those of the set, whatever dp, cp, tp, pp or the
batch shape: one checkpoint gives the same validation loss under any layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..config import IGNORE_INDEX
from .documents import Documents
from .packing import PackedBatch
from .stream import TokenBatches


@dataclass(frozen=True)
class ValidationSet:
    steps: list[list[PackedBatch]]   # this replica's micro-batches, per evaluation step
    rows: int                        # rows of the set (whole or, the last, cut by the end of the split)
    tokens: int                      # tokens of the set
    split_tokens: int                # tokens in the validation split

    @property
    def capped(self) -> bool:
        """Whether the split was smaller than the rows asked for (then the set is all of it)."""
        return self.tokens == self.split_tokens


def validation_set(documents: Documents, seq_len: int, rows: int, *, rows_per_micro_batch: int,
                   micro_batches: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                   packing: str = "documents") -> ValidationSet:
    """The `rows` x `seq_len`-token validation set as this replica evaluates it (module docstring)."""
    limit = min(rows * seq_len, documents.num_tokens)
    stream = TokenBatches(documents, seq_len, rows_per_micro_batch, dp_rank=dp_rank, dp_size=dp_size,
                          seed=seed, packing=packing)   # endless: the filler comes from what follows
    global_step_tokens = dp_size * micro_batches * stream.tokens_per_batch
    steps: list[list[PackedBatch]] = []
    for _ in range(math.ceil(limit / global_step_tokens)):
        step = []
        for _ in range(micro_batches):
            start = stream.position + dp_rank * stream.tokens_per_batch   # global token of its first
            step.append(_labels_before(next(stream), start, limit))
        steps.append(step)
    return ValidationSet(steps, math.ceil(limit / seq_len), limit, documents.num_tokens)


def _labels_before(batch: PackedBatch, start: int, limit: int) -> PackedBatch:
    """The micro-batch starting at global token `start`, with the label of every token whose target
    lies at or past global token `limit` ignored."""
    targets = start + 1 + torch.arange(batch.num_tokens).unsqueeze(0)
    if int(targets[0, -1]) < limit:
        return batch
    labels = torch.where(targets < limit, batch.labels, torch.full_like(batch.labels, IGNORE_INDEX))
    return replace(batch, labels=labels)
