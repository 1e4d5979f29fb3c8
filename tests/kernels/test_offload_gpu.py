"""The activation offload's host buffers on a GPU: mapped in huge pages, prefaulted on several threads,
then page-locked (parallel/offload.py), they carry copies to and from the device exactly, on a side
stream as the offload uses them, and go back to the system unregistered."""
import pytest
import torch

from gdn_parallel.parallel.offload import _HostPool
from tests.kernels.helpers import gpu_only
from tests.seeds import generator


@gpu_only
@pytest.mark.gpu
def test_page_locked_pool_round_trips_exactly():
    device = torch.device("cuda")
    pool = _HostPool(pin=True, device=device)
    copies = torch.cuda.Stream(device)
    gen = generator(5)
    for numel, dtype in ((96 << 20, torch.bfloat16), (12345, torch.float32), (1, torch.bfloat16)):
        x = torch.randn(numel, generator=gen).to(device, dtype)
        host = pool.take(numel, dtype)
        back = torch.empty_like(x)
        copies.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copies):
            host.copy_(x, non_blocking=True)
            back.copy_(host, non_blocking=True)
        copies.synchronize()
        assert torch.equal(back, x) and torch.equal(host.to(device), x)
        pool.give_back(host)
    assert pool.take(96 << 20, torch.bfloat16).numel() == 96 << 20   # reused, not made again
    assert pool.bytes == (96 << 20) * 2 + 12345 * 4 + 2
    pool.release()
