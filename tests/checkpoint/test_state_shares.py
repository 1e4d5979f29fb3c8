"""What each rank hands to a save (gloo, CPU): its share of every tensor, not the whole.

Replicas (dp under DDP, cp always) split what they write, and FSDP2's shards are written as they
are, so no rank copies the whole model and its AdamW moments to the host (it did: 16 GiB a rank at
h1-1.3b). The pieces put back together are the tensors of the single-device model, exactly; the
load form is each rank's whole piece; a staging failure on one rank fails the save on every rank
(it left the others waiting in the save's collectives).
"""
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from gdn_parallel.checkpoint import staging
from gdn_parallel.checkpoint.errors import CheckpointWriteError
from gdn_parallel.checkpoint.manager import CheckpointSaver
from gdn_parallel.checkpoint.state import MODEL, state_to_save, targets_to_load
from gdn_parallel.config import Config, ModelConfig, ParallelConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.mesh import build_mesh
from gdn_parallel.parallel.parallelize import parallelize
from tests.parallel.launcher import SharedLaunch, run_workers
from tests.seeds import seed_torch

LAYOUTS = {   # name: (processes, ParallelConfig fields)
    "cp2": (2, dict(cp=2)),
    "dp2_ddp": (2, dict(dp=2, data_parallel="ddp")),
    "dp2_fsdp": (2, dict(dp=2)),
    "tp2": (2, dict(tp=2)),
    "dp2_cp2_hsdp": (4, dict(dp=2, cp=2)),
    "dp2_tp2_fsdp": (4, dict(dp=2, tp=2)),
}


def model_config():
    # 2 GDN heads and 7 rows somewhere: uneven pieces and tensors too small to split are both met
    return ModelConfig(vocab_size=64, hidden_size=32, n_layers=2, layer_pattern="GS", gdn_num_heads=2,
                       gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2,
                       window_size=7, gdn_chunk_size=8, intermediate_size=48)


def _parallel(fields):
    config = ParallelConfig(**fields)
    dims = build_mesh(config, "cpu")
    seed_torch(0)
    reference = HybridLM(model_config())
    parallel = parallelize(copy.deepcopy(reference), dims, config)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
    named = list(parallel.named_parameters())
    return reference, parallel, optimizer, named, dims


def check_shares(rank, world, fields):
    reference, _parallel_model, optimizer, named, dims = _parallel(fields)
    expected = dict(reference.named_parameters())
    saved = state_to_save(named, None, dims)
    mine = total = 0
    for name, _ in named:
        value = saved[MODEL + name]
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(whole, expected[name].detach()), name   # the pieces put back together
        mine += (value.to_local() if isinstance(value, DTensor) else value).numel()
        total += expected[name].numel()
    loaded = targets_to_load(named, None, dims)
    for name, param in named:
        local = param.to_local() if isinstance(param, DTensor) else param
        target = loaded[MODEL + name]
        target = target.to_local() if isinstance(target, DTensor) else target
        if target.shape != local.shape:   # gathered to its tp piece (tp dim 0 under FSDP2, dp > 1)
            local = param.full_tensor()
        assert torch.equal(target, local.detach()), name
    return mine / total


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_saves_its_share_and_the_pieces_make_the_model(layout):
    processes, _fields = LAYOUTS[layout]
    shares = SHARES(layout)
    # every rank writes about 1/processes of the model (small tensors are written whole by DCP's
    # choice of one replica, and count here on every rank)
    assert max(shares) < 1.5 / processes, shares
    assert sum(shares) >= 1.0 - 1e-9, shares


# Cases run in launches shared by world size across the modules (tests/parallel/launcher.py, SharedLaunch).
SHARES = SharedLaunch({name: (processes, check_shares, fields)
                       for name, (processes, fields) in LAYOUTS.items()})


def failing_stage(rank, world, out_dir):
    _reference, _model, optimizer, named, dims = _parallel(dict(cp=2))
    config = Config.from_yaml("configs/tiny-cpu.yaml")
    saver = CheckpointSaver(out_dir, async_save=True)
    if rank == 1:
        def refuse(self, state):
            raise MemoryError("cannot pin 4 GiB of host memory")
        staging.HostStaging.stage = refuse
    refused = r"MemoryError: cannot pin 4 GiB of host memory \(rank 1\)"
    with pytest.raises(CheckpointWriteError, match=refused):
        saver.save(1, named, optimizer, dims, config, {})
    return True


def test_a_staging_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    assert run_workers(failing_stage, 2, str(tmp_path), timeout=120) == [True, True]
