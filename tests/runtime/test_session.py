"""The job's process group: opened for the block, closed after it; on success the backend's worker
threads get the GIL before the interpreter can shut down (a gloo worker still waiting for it then is
killed inside a noexcept frame: `terminate called without an active exception`, exit -6, after a
run that succeeded; about one cp=2 CPU job in five did so before). Every wait on a peer, joining the
group included, ends after train.collective_timeout_s, with a note that says what happened and what to do."""
import os
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gdn_parallel.config import TrainConfig
from gdn_parallel.runtime import session

REPO = Path(__file__).resolve().parents[2]


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


def test_a_single_cuda_process_binds_its_group_to_its_device(monkeypatch):
    """Unbound, the group's closing barrier warned twice after every one-GPU run ("barrier(): using the
    device under current context", "Guessing device ID based on global rank")."""
    formed = []

    def init_process_group(backend, **kwargs):
        formed.append((backend, kwargs))
        raise RuntimeError("formed")    # enough: only the arguments are checked, on a machine without CUDA
    monkeypatch.setattr(session, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(RuntimeError, match="formed"):
        with session.process_group(TrainConfig(device="cuda")):
            pass
    assert formed[0][0] == "nccl" and formed[0][1]["device_id"] == torch.device("cuda", 3)


# --- train.collective_timeout_s bounds the group's waits; communication failures say what to do ----------

def test_the_single_process_group_gets_the_configured_timeout():
    with session.process_group(TrainConfig(device="cpu", collective_timeout_s=7)):
        options = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options
        assert options._timeout == timedelta(seconds=7)


def launcher_environment(rank: int, world: int, port: str) -> dict:
    """The variables a launcher gives rank `rank` of `world` processes on this host (CPU only, no
    torchrun agent around it)."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SILENT_PEER = '''
import os, sys, time
import torch, torch.distributed as dist
from gdn_parallel.config import TrainConfig
from gdn_parallel.runtime.session import process_group

with process_group(TrainConfig(device="cpu", collective_timeout_s=float(sys.argv[1]))) as (device, launched):
    assert launched and dist.get_world_size() == 2
    if dist.get_rank() == 1:  # alive, connected, and never in the collective (as a stuck peer is)
        time.sleep(120)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        print(f"all_reduce ended after {time.monotonic() - start:.1f} s", flush=True)
'''


def test_a_silent_peer_fails_the_collective_after_the_configured_timeout(tmp_path):
    """Two processes through the launcher variables (session.process_group -> init_distributed): rank 1
    never joins rank 0's all_reduce, which fails after train.collective_timeout_s (torch's gloo default:
    30 minutes), with a note naming the field and what to do."""
    script = tmp_path / "silent_peer.py"
    script.write_text(SILENT_PEER)
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env = launcher_environment(rank, 2, port)
        ranks.append(subprocess.Popen([sys.executable, str(script), "3"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        output, _ = ranks[0].communicate(timeout=90)
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    waited = float(re.search(r"all_reduce ended after ([0-9.]+) s", output).group(1))
    assert ranks[0].returncode == 1 and 2.5 <= waited < 20, output
    assert "Timed out" in output, output
    assert ("PeerLost: rank 0: a collective with the other ranks failed (a peer ended, or did not answer "
            "within train.collective_timeout_s=3 s: ") in output, output
    assert "Start the job again with --resume auto" in output, output


def test_a_communication_failure_is_told_apart_from_other_errors():
    assert session.is_communication_failure(RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    assert session.is_communication_failure(dist.DistStoreError("wait timeout"))
    assert not session.is_communication_failure(RuntimeError("CUDA out of memory"))
