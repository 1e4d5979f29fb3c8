"""Validation under any layout: the loss over a fixed set of validation rows, and the same loss split
by where a token sits in its document, to see whether the loss keeps falling with context.

Position buckets grow by 4x from 64 tokens ([0, 64), [64, 256), [256, 1024), ... up to the sequence
length). The loss of a bucket is measured by evaluating the rows with every label outside the
bucket ignored; the buckets partition the labelled tokens, so their losses add up to the whole
(one forward per bucket: exact under every layout, at a few forwards per evaluation).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..config import IGNORE_INDEX


def position_buckets(seq_len: int, first: int = 64, factor: int = 4) -> List[Tuple[int, int]]:
    """[start, end) position ranges covering [0, seq_len)."""
    edges = [0]
    edge = first
    while edge < seq_len:
        edges.append(edge)
        edge *= factor
    edges.append(seq_len)
    return list(zip(edges, edges[1:]))


def _labels_in(row, start: int, end: int):
    """The row with every label whose token is outside positions [start, end) ignored. The label of
    token t predicts token t + 1; its position is that of token t in its document."""
    positions = row.position_ids
    inside = (positions >= start) & (positions < end)
    labels = torch.where(inside, row.labels, torch.full_like(row.labels, IGNORE_INDEX))
    return replace(row, labels=labels)


def evaluate(parallel, rows_per_step: Sequence[Sequence], seq_len: int,
             autocast_dtype: Optional[torch.dtype]) -> Dict[str, object]:
    """{"val_loss": mean over all labelled tokens, "val_loss_by_position": {"start-end": loss}} over
    the given micro-batch lists (each a list of this replica's rows for one evaluation step);
    val_loss is None when there are no labelled tokens."""
    by_bucket = {}
    total_sum, total_count = 0.0, 0
    for start, end in position_buckets(seq_len):
        bucket_sum, bucket_count = 0.0, 0
        for rows in rows_per_step:
            loss_sum, count = parallel.evaluate([_labels_in(r, start, end) for r in rows], autocast_dtype)
            bucket_sum, bucket_count = bucket_sum + loss_sum, bucket_count + count
        if bucket_count:
            by_bucket[f"{start}-{end}"] = bucket_sum / bucket_count
        total_sum, total_count = total_sum + bucket_sum, total_count + bucket_count
    return {"val_loss": total_sum / total_count if total_count else None, "val_loss_by_position": by_bucket}
