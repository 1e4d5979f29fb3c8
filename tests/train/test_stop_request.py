"""The ranks' stop vote (train/stop_request.py): a SIGTERM on any one rank stops every rank after the
same step; read at once (CPU) or one step after it was cast (lag 1, as on CUDA, where reading at once
would make the host wait for each step's kernels)."""
import os
import signal

import pytest

from gdn_parallel.train.stop_request import StopRequest
from tests.parallel.launcher import run_workers

SIGNALLED_BEFORE_STEP = 2


def _votes(rank, world_size, lag):
    stop = StopRequest(lag=lag)
    try:
        agreed = []
        for step in range(5):
            if rank == world_size - 1 and step == SIGNALLED_BEFORE_STEP:
                os.kill(os.getpid(), signal.SIGTERM)  # through the handler, on this rank only
            agreed.append(stop.agreed(device="cpu"))
        return stop.requested, agreed
    finally:
        stop.restore()


@pytest.mark.parametrize("lag", [0, 1])
def test_one_rank_signalled_stops_every_rank_after_the_same_step(lag):
    results = run_workers(_votes, 2, lag)
    assert [requested for requested, _ in results] == [False, True]  # only the last rank got the signal
    first_true = SIGNALLED_BEFORE_STEP + lag
    expected = [step >= first_true for step in range(5)]
    assert [agreed for _, agreed in results] == [expected, expected]


def test_one_process_reads_its_own_flag_at_once():
    results = run_workers(_votes, 1, 1)
    assert results == [(True, [False, False, True, True, True])]


def test_the_handlers_are_given_back():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    assert signal.getsignal(signal.SIGTERM) != before
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before
