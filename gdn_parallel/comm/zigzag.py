"""Zigzag balance of full causal attention over the contiguous CP split (docs/design.md §2).

Under the contiguous split a query at global index i attends to i + 1 keys, so rank r of n computes
(2r + 1) / n² of the row's attention (7/16 for the last of 4) and every rank waits for the last one.
The row stays split contiguously (the GDN relay, the convolutions and the sliding-window halos need
that); only the queries of full attention move. The row is cut into 2n blocks of equal length, the
shard of rank r being blocks 2r and 2r + 1, and rank r computes query blocks r and 2n - 1 - r: one
early and one late block each, the same number of (query, key) pairs on every rank.

`to_workers` sends each query block from its owner to the rank that computes it, `to_owners` sends
each output block back; both are one all-to-all over the CP group, differentiable (the backward of
one is the other, run on the gradients). Under activation checkpointing a recomputed block replays
what it received (comm/replay.py), as the all-gather does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import replay
from .context import CPContext


def worker_of(block: int, size: int) -> int:
    """The rank that computes query block `block` of the row's 2 x `size`."""
    return block if block < size else 2 * size - 1 - block


def owner_of(block: int) -> int:
    """The rank whose contiguous shard holds block `block` (two blocks a shard)."""
    return block // 2


def owned_blocks(rank: int) -> tuple[int, int]:
    return 2 * rank, 2 * rank + 1


def worked_blocks(rank: int, size: int) -> tuple[int, int]:
    """The query blocks rank `rank` computes, in the order of its worked tensor."""
    return rank, 2 * size - 1 - rank


def block_length(cp: CPContext) -> int:
    """Tokens per query block (half a shard); a clear error where the shard does not halve."""
    if cp.local_len % 2:
        raise ValueError(f"parallel.cp_attention_split=zigzag cuts each CP shard into two equal query "
                         f"blocks, and the shard has {cp.local_len} tokens (odd): make the row divisible "
                         f"by 2 x parallel.cp = {2 * cp.size} or use parallel.cp_attention_split=contiguous")
    if cp.chunks > 1:
        raise ValueError("zigzag attention moves query blocks between every CP rank at once, which sequence "
                         "chunks run in turn (train.recompute_chunks) cannot: full attention is refused "
                         "with recompute chunks")
    return cp.local_len // 2


def worked_positions(cp: CPContext) -> torch.Tensor:
    """Global token indices of the queries this rank computes (host tensor, [local_len]; made once per
    plan, as its other index tensors: every full attention layer of the row asks)."""
    cached = cp.__dict__.get("_zigzag_positions_cache")
    if cached is None:
        length = block_length(cp)
        cached = cp.__dict__["_zigzag_positions_cache"] = torch.cat(
            [torch.arange(b * length, (b + 1) * length) for b in worked_blocks(cp.rank, cp.size)])
    return cached


@dataclass(frozen=True)
class _Route:
    """One direction of the exchange, seen from one rank. `layout`: the blocks of the local tensor
    in its order; `arriving`: those of the result. Each buffer of the all-to-all is ordered by peer,
    then by block, on both sides, so a sender's and a receiver's orders agree."""
    layout: tuple[int, ...]
    arriving: tuple[int, ...]
    send_order: tuple[int, ...]    # positions in `layout`, by destination then block
    send_counts: tuple[int, ...]   # blocks to each rank
    recv_blocks: tuple[int, ...]   # blocks in the receive buffer, by source then block
    recv_counts: tuple[int, ...]   # blocks from each rank

    @classmethod
    def make(cls, size: int, layout, arriving, destination, source) -> _Route:
        send_order = tuple(sorted(range(len(layout)), key=lambda i: (destination(layout[i]), layout[i])))
        recv_blocks = tuple(sorted(arriving, key=lambda b: (source(b), b)))
        return cls(tuple(layout), tuple(arriving), send_order,
                   tuple(sum(destination(b) == peer for b in layout) for peer in range(size)),
                   recv_blocks, tuple(sum(source(b) == peer for b in arriving) for peer in range(size)))

    def move(self, cp: CPContext, x: torch.Tensor) -> torch.Tensor:
        """x [blocks x length, ...] laid out as `layout` -> [.., ...] laid out as `arriving`."""
        length = x.shape[0] // len(self.layout)
        pieces = x.split(length)
        outgoing = torch.cat([pieces[i] for i in self.send_order]).contiguous()
        incoming = outgoing.new_empty((len(self.recv_blocks) * length, *x.shape[1:]))
        dist.all_to_all_single(incoming, outgoing, [c * length for c in self.recv_counts],
                               [c * length for c in self.send_counts], group=cp.group)
        if self.recv_blocks == self.arriving:
            return incoming
        received = dict(zip(self.recv_blocks, incoming.split(length)))
        return torch.cat([received[b] for b in self.arriving])


def _routes(cp: CPContext) -> tuple[_Route, _Route]:
    """(owners -> workers, workers -> owners) of this rank."""
    size = cp.size

    def worker(b):
        return worker_of(b, size)

    owned, worked = owned_blocks(cp.rank), worked_blocks(cp.rank, size)
    return (_Route.make(size, owned, worked, worker, owner_of),
            _Route.make(size, worked, owned, owner_of, worker))


class _MoveBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, there, back):
        ctx.cp, ctx.back = cp, back
        if replay.replaying():  # a recomputed block: what the first forward received
            return replay.replay()
        moved = there.move(cp, x)
        replay.record(moved)
        return moved

    @staticmethod
    def backward(ctx, grad):
        return ctx.back.move(ctx.cp, grad.contiguous()), None, None, None


def to_workers(cp: CPContext, x: torch.Tensor) -> torch.Tensor:
    """This rank's shard [local_len, ...] (blocks 2r, 2r + 1) -> the query blocks it computes
    [local_len, ...] (blocks r, 2n - 1 - r), differentiable."""
    block_length(cp)
    there, back = _routes(cp)
    return _MoveBlocks.apply(x, cp, there, back)


def to_owners(cp: CPContext, y: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_workers`: results of the worked blocks back to the shards that own them."""
    block_length(cp)
    back, there = _routes(cp)
    return _MoveBlocks.apply(y, cp, there, back)
