"""The job's process group: opened for the block, closed after it; on success the backend's worker
threads get the GIL before the interpreter can shut down (a gloo worker still waiting for it then is
killed inside a noexcept frame: `terminate called without an active exception`, exit -6, after a
run that succeeded; about one cp=2 CPU job in five did so before)."""
import pytest
import torch.distributed as dist

from gdn_parallel.config import TrainConfig
from gdn_parallel.runtime import session


@pytest.fixture
def pauses(monkeypatch):
    seen = []
    monkeypatch.setattr(session.time, "sleep", lambda s: seen.append(("sleep", s, dist.is_initialized())))
    return seen


def test_success_hands_the_gil_to_the_workers_while_the_group_is_open(pauses):
    with session.process_group(TrainConfig(device="cpu")) as (device, launched):
        assert dist.is_initialized() and device.type == "cpu" and not launched
        assert pauses == []
    assert not dist.is_initialized()
    assert pauses == [("sleep", session._SETTLE_S, True)] and session._SETTLE_S >= 0.1


def test_an_error_closes_the_group_without_waiting_on_peers(pauses):
    with pytest.raises(RuntimeError, match="boom"):
        with session.process_group(TrainConfig(device="cpu")):
            raise RuntimeError("boom")
    assert not dist.is_initialized()
    assert pauses == []  # a failed peer would never reach the barrier
