"""What a recomputed block received: kept from its first forward, read back when it is recomputed.

Activation checkpointing recomputes a block in the backward. Re-running its CP hand-overs there
would make each rank's backward of a layer wait for the previous rank's recomputation of the same
layer (the incoming state), while that rank waits for this one's gradient: a wait per layer,
ping-ponging between ranks. The recomputation is deterministic, so instead every message received
(states, halos, all-gathered summaries) is logged in the block's first forward and replayed, in the
same order, when the block is recomputed; the sends of the recomputation are skipped, since their
receivers replay too. Gradient hand-overs in the backward are unchanged.

Each checkpointed call owns one ReplayLog (parallel/checkpointing.py passes its two contexts to
torch.utils.checkpoint), so interleaved micro-batches (pipeline schedules) never mix their logs.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_active = threading.local()


class ReplayLog:
    def __init__(self):
        self.messages: list = []
        self.read = 0

    @contextlib.contextmanager
    def _as(self, mode: str):
        previous = getattr(_active, "value", None)
        _active.value = (self, mode)
        try:
            yield
        finally:
            _active.value = previous

    def recording(self):
        self.messages.clear()
        return self._as("record")

    def replaying(self):
        self.read = 0
        return self._as("replay")


def replaying() -> bool:
    """True while a checkpointed block is being recomputed: its hand-overs are replayed, not sent."""
    state = getattr(_active, "value", None)
    return state is not None and state[1] == "replay"


def record(message: torch.Tensor) -> None:
    """Log a received tensor (a no-op outside a checkpointed block's first forward)."""
    state = getattr(_active, "value", None)
    if state is not None and state[1] == "record":
        state[0].messages.append(message)


def replay() -> torch.Tensor:
    """The next logged message of the block being recomputed."""
    log = _active.value[0]
    if log.read >= len(log.messages):
        raise RuntimeError("a recomputed block received more messages than its first forward did: the "
                           "recomputation is not the same computation (non-deterministic control flow?)")
    log.read += 1
    return log.messages[log.read - 1]
