"""The checkpoint's file writer makes no CUDA call: the tensors it writes are host copies already
(checkpoint/staging.py). DCP's default writer, on a machine with CUDA, reads them through a loader
that takes the writing thread's current CUDA stream and synchronizes it every ~10 MB; in a background
save that thread sits on GPU 0 of every rank. On 4 H100s at 1M tokens (h1-1.3b, cp = 4) the step
after a background save took x1.76 the median with that writer; x1.02 without it (4 H200s,
docs/multi_gpu/README.md). CUDA is faked here: the test counts what the writer asks of it."""
import contextlib

import torch
import torch.distributed.checkpoint as dcp

from gdn_parallel.checkpoint import manager


class _RecordingStream:
    def __init__(self, calls: list):
        self.calls = calls

    def synchronize(self):
        self.calls.append("synchronize")

    def wait_stream(self, _other):
        self.calls.append("wait_stream")


def _cuda_faked(monkeypatch) -> list:
    """torch.cuda reports a device, and every stream request is recorded instead of made."""
    calls: list = []

    def current_stream(*_args):
        calls.append("current_stream")
        return _RecordingStream(calls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda _stream: contextlib.nullcontext())
    return calls


def _state() -> dict[str, torch.Tensor]:
    # several tensors over the default writer's 10 MB copy-ahead, so that its loader waits on the stream
    return {f"weight_{i}": torch.randn(1024, 1024) for i in range(4)}


def test_the_writer_makes_no_cuda_call_for_host_tensors(tmp_path, monkeypatch):
    calls = _cuda_faked(monkeypatch)
    state = _state()
    dcp.save(state, storage_writer=manager._host_writer(tmp_path / "ours"), no_dist=True)
    assert calls == []
    monkeypatch.undo()
    loaded = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_the_default_writer_would_wait_on_the_stream(tmp_path, monkeypatch):
    """The fake above sees DCP's default writer's stream calls (so the test above can fail)."""
    calls = _cuda_faked(monkeypatch)
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "default")), no_dist=True)
    assert "synchronize" in calls
