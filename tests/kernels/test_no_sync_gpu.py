"""The training step on a GPU never makes the host wait for the device (issue 26): a second step, on a
batch of another document layout, runs forward, backward, clipping, the fused AdamW step (skipped on
the device were the step not finite) and the ranks' stop vote under
torch.cuda.set_sync_debug_mode("error"), which raises at any synchronising call (.item(), a copy to
the host, a copy from pageable host memory). The first step, outside it, compiles and autotunes.
The CPU stand-in of this test: tests/train/test_host_reads.py."""
import pytest
import torch
import torch.distributed as dist

from gdn_parallel.config import ModelConfig, ParallelConfig
from gdn_parallel.data.packing import packed_batches
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.mesh import build_mesh
from gdn_parallel.parallel.parallelize import parallelize
from gdn_parallel.train.step_outcome import step_unless_non_finite
from gdn_parallel.train.stop_request import StopRequest
from tests.kernels.helpers import gpu_only
from tests.seeds import generator, seed_torch


@gpu_only
@pytest.mark.gpu
def test_a_training_step_does_not_synchronise():
    config = ModelConfig(vocab_size=512, hidden_size=256, n_layers=4, layer_pattern="GSGA", gdn_num_heads=4,
                         gdn_head_dim=64, attn_num_heads=4, window_size=128, intermediate_size=512)
    seed_torch(0)
    gen = generator(1)
    documents = [torch.randint(0, 512, (int(n),), generator=gen)
                 for n in torch.randint(50, 900, (40,), generator=gen)]
    batches = packed_batches(documents, 1024, 2, seed=2)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # as the trainer
    try:
        parallel = parallelize(HybridLM(config).cuda(), build_mesh(ParallelConfig(), "cuda"))
        optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-4, fused=True)

        def step():
            rows = [next(batches).to("cuda", non_blocking=True) for _ in range(2)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = parallel.train_step(rows, autocast_dtype=torch.bfloat16)
            norm = parallel.clip_grad_norm(1.0)
            # the trainer's: the skip of a non-finite step decided on the device, the stop vote cast
            outcome = step_unless_non_finite(optimizer, 0, loss, 1e-4, norm)
            stop.cast_vote(torch.device("cuda"))
            optimizer.zero_grad(set_to_none=True)
            return loss, norm, outcome

        stop = StopRequest(lag=1)
        try:
            step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss, norm, outcome = step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        finally:
            stop.restore()
        assert torch.isfinite(loss) and torch.isfinite(norm)
        assert outcome.applied() and not any(vote.value() for vote in stop._votes)
    finally:
        dist.destroy_process_group()
