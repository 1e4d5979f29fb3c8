"""Model-level context parallelism: shard a packed batch, take the global loss, reduce gradients.

The loss of a shard is its summed cross-entropy divided by the *global* label count, so the sum of
the ranks' losses is the single-device loss and the sum of their gradients is its gradient.
Parameters are replicated over CP; their gradients are summed over the CP group (folded into the
dp x cp reduction by the data-parallel wrapper).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.context import CPContext, shard_bounds
from ..config import IGNORE_INDEX
from ..model.sequence import SequenceInfo
from ..ops.rope import positions_from_cu_seqlens


@dataclass
class CPShard:
    input_ids: torch.Tensor       # [1, L]
    labels: torch.Tensor          # [1, L]
    position_ids: torch.Tensor    # [1, L] positions inside the (global) documents
    context: CPContext
    num_label_tokens: int         # over the whole row, all ranks

    def sequence_info(self) -> SequenceInfo:
        return SequenceInfo(cu_seqlens=None, position_ids=self.position_ids, cp=self.context)


def shard_batch(batch, cp_rank: int, cp_size: int, group: dist.ProcessGroup | None = None,
                algorithm: str = "relay", attention_split: str = "contiguous") -> CPShard:
    """Split a packed batch (input_ids/labels/position_ids [1, total], cu_seqlens) contiguously and
    return rank `cp_rank`'s shard with its CP plan. The labels were made on the whole row, so the
    last token of a shard keeps the first token of the next shard as its label. `algorithm` and
    `attention_split`: parallel.cp_algorithm and parallel.cp_attention_split, kept in the plan."""
    if batch.input_ids.dim() != 2 or batch.input_ids.shape[0] != 1:
        raise ValueError(f"context parallelism takes one packed row [1, total], got input_ids of shape "
                         f"{tuple(batch.input_ids.shape)}")
    total = batch.input_ids.shape[1]
    start, end = shard_bounds(total, cp_size, cp_rank, "train.seq_len * train.batch_size")
    context = CPContext.build(group, batch.cu_seqlens, end - start, algorithm,
                              device=batch.input_ids.device, rank=cp_rank, size=cp_size,
                              attention_split=attention_split)
    positions = batch.position_ids
    if positions is None:
        positions = positions_from_cu_seqlens(batch.cu_seqlens, total, batch.input_ids.device).unsqueeze(0)
    return CPShard(
        input_ids=batch.input_ids[:, start:end],
        labels=batch.labels[:, start:end],
        position_ids=positions[:, start:end],
        context=context,
        num_label_tokens=label_count(batch),
    )


def label_count(row) -> int:
    """Tokens with a target in a row: the count a PackedBatch brought from the host, else counted here
    (a device sync when the labels are on a GPU)."""
    counted = getattr(row, "label_count", None)
    return counted() if callable(counted) else int((row.labels != IGNORE_INDEX).sum())


def cp_loss(model, shard: CPShard) -> torch.Tensor:
    """This rank's share of the global mean loss (sums to the single-device loss over the group).
    Its sends complete by `shard.context.finish()`, once the backward has run too."""
    out = model(shard.input_ids, labels=shard.labels, seq=shard.sequence_info())
    return out.loss_sum / max(shard.num_label_tokens, 1)


def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum parameter gradients over the CP group (one flat all-reduce per dtype)."""
    all_reduce_flat([p.grad for p in model.parameters() if p.grad is not None], group)


def all_reduce_flat(tensors: list, group: dist.ProcessGroup | None) -> None:
    """Sum tensors in place over `group` with one all-reduce per dtype (flattened together)."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
