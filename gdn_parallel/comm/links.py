"""The point-to-point links between neighbouring CP ranks, made once before the first step.

Every hand-over (a GDN state, a halo, their gradients) goes from a CP rank to its neighbour. On
NCCL, an unbatched send or receive on a larger group makes a new two-rank communicator the first
time a pair talks, inside the first timed step, and every rank prints a warning about it. Here each
neighbouring pair gets a two-rank group of its own when the mesh is built (the CP group itself where
it has only two ranks), its communicator is made by one small exchange there, and the hand-overs run
as batched P2P ops on it, which use that group's own communicator. A pair's traffic keeps its own
stream, so rank r's send to r + 1 never queues behind its receive from r - 1.

Ranks that no link joins (a test's own group) fall back to plain P2P ops on the plan's group.
"""
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

# (lower global rank, higher) -> (the default group it was made under, the pair's group): a link made
# under a process group since destroyed is not used
_LINKS: dict[tuple[int, int], tuple[object, dist.ProcessGroup]] = {}


def connect_neighbours(rank_lists: Sequence[Sequence[int]], groups: Sequence[dist.ProcessGroup | None],
                       device: torch.device, timeout: timedelta | None = None,
                       backend: str | None = None) -> int:
    """Make the links of every CP group (`rank_lists`, global ranks in CP order; `groups[i]` this rank's
    group for `rank_lists[i]`, or None where this rank is not in it). A collective of the whole world:
    every rank calls it with the same lists. Returns the number of links this rank joined."""
    pairs: list[tuple[tuple[int, int], dist.ProcessGroup]] = []
    for ranks, group in zip(rank_lists, groups):
        for a, b in zip(ranks, ranks[1:]):
            # the CP group is the pair where it has two ranks; else new_group, a collective of the
            # world, made in the same order on every rank
            pair_group = (group if len(ranks) == 2
                          else dist.new_group([a, b], timeout=timeout, backend=backend))
            if dist.get_rank() in (a, b):
                if pair_group is None:
                    raise ValueError(f"rank {dist.get_rank()} is in CP group {list(ranks)} but was given no "
                                     f"group for it")
                pairs.append(((a, b), pair_group))
    # each pair in the order of the CP row, rank 0's first: no rank waits for one that waits for it
    for (a, b), group in pairs:
        _LINKS[(a, b)] = (dist.group.WORLD, group)
        _warm_up(a, b, group, device)
    return len(pairs)


def _warm_up(a: int, b: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """One small batched exchange: NCCL makes the pair's communicator here, not in the first step."""
    me, peer = (a, b) if dist.get_rank() == a else (b, a)
    batched_p2p(dist.isend if me == a else dist.irecv, torch.zeros(1, device=device), peer, group).wait()


def link(peer: int) -> dist.ProcessGroup | None:
    """This rank's link to global rank `peer`, or None when there is none."""
    me = dist.get_rank()
    world, group = _LINKS.get((min(me, peer), max(me, peer)), (None, None))
    return group if world is not None and world is dist.group.WORLD else None


def isend(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None):
    """Start sending to global rank `peer`: on its link when there is one, else on `group`."""
    return _p2p(dist.isend, tensor, peer, group)


def irecv(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None):
    """Start receiving from global rank `peer` into `tensor` (see isend)."""
    return _p2p(dist.irecv, tensor, peer, group)


def batched_p2p(op, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup):
    """One send or receive (`op`: dist.isend or dist.irecv) with global rank `peer` as a batch of its
    own: it runs on `group`'s communicator, where an unbatched op would make a two-rank one."""
    return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)])[0]


def _p2p(op, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None):
    pair_group = link(peer)
    if pair_group is None:
        return op(tensor, peer, group=group)
    return batched_p2p(op, tensor, peer, pair_group)
