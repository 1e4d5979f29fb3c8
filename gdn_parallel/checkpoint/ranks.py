"""The ranks of a checkpoint collective agreeing: on where small buffers live, and on failures.

A save or load step that fails on some ranks only (one rank's file, rank 0's metadata) must fail on
every rank: the others would otherwise wait in the next collective until the process-group timeout.
`agree` runs a step on this rank and raises the first rank's error on all of them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gathered(value):
    """Every rank's `value`, in rank order (a collective)."""
    if world() == 1:
        return [value]
    values: list = [None] * world()
    dist.all_gather_object(values, value)
    return values


def agree(step: Callable[[], T], failure: Callable[[str], BaseException]) -> T | None:
    """Run `step` on this rank; if it raised on any rank, raise `failure(<that rank's error>)` on every
    rank (the lowest failing rank's). Returns this rank's result."""
    result, error = None, None
    try:
        result = step()
    except Exception as err:  # said on every rank below, with the rank that met it
        error = (str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}") \
            + (f" (rank {rank()})" if world() > 1 else "")
    errors = [e for e in gathered(error) if e is not None]
    if errors:
        raise failure(errors[0])
    return result


def describe(err: BaseException) -> str:
    """'Type: first line' of an error; for DCP's CheckpointException (which wraps every rank's error
    with its traceback), the lowest failing rank's."""
    failures = getattr(err, "failures", None)
    if failures:
        err = failures[min(failures)]
        err = err[0] if isinstance(err, tuple) else err
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
