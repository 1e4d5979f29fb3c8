"""SIGTERM / SIGINT ask a run to stop: the step in flight finishes, a checkpoint is saved, the run ends.

A signal reaches the ranks at different moments (torchrun forwards it to each worker, Slurm signals each
task), so they vote at every step and stop together when any rank was asked (an all-reduce MAX over
the training group). Reading the vote at once would make the host wait for the step's kernels at every
step (the vote is queued behind them on the GPU) and the GPU then idle while the host launches the next
step. On CUDA the vote is therefore read one step after it was cast (`lag`): by then the device is past
it, since the host has already waited for that step's end when it booked its outcome
(step_outcome.py). The run stops at most one step later than a read at once would; on CPU (gloo's
all-reduce returns with the value) the vote is read at once. One process reads its own flag.
"""
from __future__ import annotations

import signal
import threading
from collections import deque

import torch
import torch.distributed as dist

from .step_outcome import ArrivingFlag


class StopRequest:
    """Installs SIGTERM / SIGINT handlers (main thread only) that set `requested`; `agreed` is the vote."""

    def __init__(self, lag: int = 0):
        self.requested = False
        self.lag = lag                      # steps between casting a vote and reading it
        self._votes: deque[ArrivingFlag] = deque()
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    @classmethod
    def for_device(cls, device: torch.device) -> StopRequest:
        return cls(lag=1 if device.type == "cuda" else 0)

    def _handle(self, signum, _frame):
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Cast this step's vote and return the one due now: whether any rank had been asked to stop
        when it voted `lag` steps ago. A collective: every rank calls it once per step."""
        if dist.get_world_size() == 1:
            return self.requested
        self.cast_vote(device)
        if len(self._votes) <= self.lag:
            return False
        return self._votes.popleft().value()

    def cast_vote(self, device: torch.device) -> None:
        """Queue this rank's vote and its way to the host, without waiting for the device."""
        # A fill kernel: torch.tensor([...], device=cuda) copies from pageable host memory, which waits
        # for every queued kernel.
        vote = torch.full((1,), float(self.requested), device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        self._votes.append(ArrivingFlag(vote > 0))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
