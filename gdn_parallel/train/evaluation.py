"""Validation under any layout: the loss over a fixed set of validation rows, and the same loss split
by where a token sits in its document, to see whether the loss keeps falling with context.

Position buckets grow by 4x from 64 tokens ([0, 64), [64, 256), [256, 1024), ... up to the sequence
length). The loss of a bucket is measured by evaluating the rows with every label outside the
bucket ignored; the buckets partition the labelled tokens, so their losses add up to the whole
(one forward per bucket: exact under every layout, at a few forwards per evaluation).

Bits: `val_bits_per_token` is val_loss / ln 2. `val_bpb`, bits per byte of text, is the summed loss
of every labelled token of the set, in nats, / ln 2 / the UTF-8 bytes of the text those tokens' targets
stand for (the data's count of bytes per token, made when it was prepared: data/prepared.py;
byte-level data: one per token, where the two agree). A target that stands for no text (an eos a
tokenizer appends) adds its loss and no bytes. Data that does not record its bytes gets no val_bpb.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..config import IGNORE_INDEX
from ..data.dataset import data_field
from ..data.validation import validation_set


def position_buckets(seq_len: int, first: int = 64, factor: int = 4) -> list[tuple[int, int]]:
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


def validation_text_bytes(dataset, config, say=None) -> int | None:
    """The UTF-8 bytes of text that the labelled tokens' targets of the validation set stand for (the
    set of data/validation.py: its first train.eval_rows rows), or None when the data does not record
    them (then `say` is told once that val_bpb is not reported).

    The set is built again over the byte counts instead of the ids: the same documents, lengths, seed
    and packing give the same rows and labelled positions (one set under every layout and batch
    shape, so one replica with one row per micro-batch finds all of it), each label now the byte
    count of its target token."""
    counts = dataset.val_token_bytes
    if counts is None:
        if say is not None:
            say(f"eval  | val_bpb not reported: {data_field(config.data)} does not record the bytes of text "
                f"its tokens stand for (prepared before they were recorded, a Megatron dataset or a blend of "
                f"such): gdn-prepare-data records them; val_bits_per_token is logged")
        return None
    found = validation_set(counts, config.train.seq_len, config.train.eval_rows, rows_per_micro_batch=1,
                           micro_batches=1, seed=config.data.seed, packing=config.data.packing)
    return sum(int(row.labels[row.labels != IGNORE_INDEX].sum()) for step in found.steps for row in step)


def evaluate(parallel, rows_per_step: Sequence[Sequence], seq_len: int,
             autocast_dtype: torch.dtype | None, text_bytes: int | None = None) -> dict[str, object]:
    """{"val_loss": mean over all labelled tokens, "val_bits_per_token", "val_bpb" (bits per byte of
    the `text_bytes` the labelled targets stand for; None when unknown), "val_loss_by_position":
    {"start-end": loss}} over the given micro-batch lists (each a list of this replica's rows for one
    evaluation step); the losses are None when there are no labelled tokens."""
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
    val_loss = total_sum / total_count if total_count else None
    return {"val_loss": val_loss, "val_bits_per_token": None if val_loss is None else val_loss / math.log(2),
            "val_bpb": total_sum / math.log(2) / text_bytes if total_count and text_bytes else None,
            "val_loss_by_position": by_bucket}
