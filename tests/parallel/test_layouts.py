"""Every parallel layout through `parallelize` equals one process: loss, every parameter gradient
(gathered to full shape), the global gradient norm, and the parameters after two AdamW steps."""
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from gdn_parallel.config import ModelConfig, ParallelConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.mesh import build_mesh
from gdn_parallel.parallel.parallelize import parallelize
from gdn_parallel.parallel.tensor import full_tensor
from tests.compare import assert_close_set, rel_err
from tests.parallel.batches import make_batch
from tests.parallel.launcher import SharedLaunch
from tests.seeds import seed_torch, seeded
from tests.verify.helpers import LAYOUTS

ROW_LAYOUTS = [[0, 48], [0, 5, 19, 20, 40, 48], [0, 1, 30, 31, 48], [0, 24, 25, 48]]
MICROBATCHES = 2

CI_LAYOUTS = ["tp2", "tp2_sp", "pp2_1f1b", "pp2_interleaved", "dp2_fsdp", "dp2_ddp", "cp2", "tp2_cp2",
              "pp2_cp2", "pp2_tp2", "dp2_cp2", "dp2_tp2"]
EIGHT_PROCESS_LAYOUTS = {"pp2_tp2_cp2": LAYOUTS["pp2_tp2_cp2"], "dp2_tp2_cp2_sp_ddp": dict(
    dp=2, tp=2, cp=2, sequence_parallel=True, data_parallel="ddp")}


def model_config():
    return ModelConfig(vocab_size=64, hidden_size=32, n_layers=4, layer_pattern="GSAG", gdn_num_heads=2,
                       gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2,
                       window_size=7, gdn_chunk_size=8, intermediate_size=48)


def full(t, param, dims):
    if getattr(param, "_tp_shard_dim", None) is not None:
        return full_tensor(t, param, dims.group("tp"))
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_layout(rank, world, layout, activation_checkpointing="none"):
    config = ParallelConfig(**layout)
    dims = build_mesh(config, "cpu")
    seed_torch(0)
    reference = HybridLM(model_config()).double()
    parallel = parallelize(copy.deepcopy(reference), dims, config,
                           activation_checkpointing=activation_checkpointing)
    ref_params = dict(reference.named_parameters())
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        # rows[d][m]: microbatch m of data-parallel replica d; the reference sees them all.
        rows = [[make_batch(ROW_LAYOUTS[(d + m + step) % 4], seed=100 * step + 10 * d + m)
                 for m in range(MICROBATCHES)] for d in range(config.dp)]
        loss_sum = sum(reference(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens).loss_sum
                       for replica in rows for b in replica)
        count = sum(int((b.labels != -100).sum()) for replica in rows for b in replica)
        (loss_sum / count).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)

        loss = parallel.train_step(rows[dims.rank("dp")])
        norm = parallel.clip_grad_norm(0.5)
        tag = f"{layout} step {step} rank {rank}"
        assert rel_err(loss, (loss_sum / count).detach()) < 1e-12, tag   # a loss near log(vocab)
        assert rel_err(norm, ref_norm) < 1e-12, f"grad norm, {tag}"
        named = parallel.named_parameters()
        assert named, tag
        assert_close_set({name: full(p.grad, p, dims) for name, p in named},
                         {name: ref_params[name].grad for name, _ in named}, 1e-9, f"grads, {tag}")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_close_set({name: full(p.detach(), p, dims) for name, p in named},
                         {name: ref_params[name].detach() for name, _ in named}, 1e-9, f"after step, {tag}")
    return True


def world_of(layout):
    return ParallelConfig(**layout).world_size


RECOMPUTED_LAYOUTS = ["cp2", "pp2_cp2", "dp2_tp2"]


@pytest.mark.parametrize("name", CI_LAYOUTS)
def test_layout_matches_single_process(name):
    assert all(LAYOUT_CASES((name, "none")))


@pytest.mark.parametrize("name", RECOMPUTED_LAYOUTS)
def test_layout_with_activation_checkpointing_matches_single_process(name):
    """Recomputed blocks re-run their CP hand-overs, TP collectives and FSDP gathers: still exact."""
    assert all(LAYOUT_CASES((name, "full")))


@pytest.mark.parametrize("name", list(EIGHT_PROCESS_LAYOUTS))
def test_eight_process_layout_matches_single_process(name):
    assert all(LAYOUT_CASES((name, "none")))


def check_fsdp_bf16_autocast(rank, world):
    """bf16 autocast over several microbatches under FSDP2 equals one device under the same
    autocast up to bf16 rounding (a cached weight cast once lost most of the gradient: error 0.76)."""
    from tests.verify.helpers import norm_err, packed_row
    from tests.verify.helpers import single_device_loss as _single_device_loss

    config = ParallelConfig(dp=2)
    dims = build_mesh(config, "cpu")
    seed_torch(0)
    single = HybridLM(model_config())
    parallel = parallelize(copy.deepcopy(single), dims, config)
    rows = [[packed_row(48, 64, seeded(10 * d + m), torch.device("cpu")) for m in range(2)] for d in range(2)]
    _single_device_loss(single, rows, torch.bfloat16)
    parallel.train_step(rows[dims.rank("dp")], autocast_dtype=torch.bfloat16)
    reference = dict(single.named_parameters())
    for name, p in parallel.named_parameters():
        err = norm_err(full(p.grad, p, dims), reference[name].grad)
        assert err < 0.1, f"{name}: {err:.3g}"
    return True


def test_fsdp_with_bf16_autocast_over_microbatches():
    assert all(LAYOUT_CASES("fsdp_bf16_autocast"))


# Every case of this module by (layout, activation checkpointing), run in launches shared by world size
# across the modules (tests/parallel/launcher.py, SharedLaunch).
LAYOUT_CASES = SharedLaunch({
    **{(name, "none"): (world_of(LAYOUTS[name]), check_layout, LAYOUTS[name]) for name in CI_LAYOUTS},
    **{(name, "full"): (world_of(LAYOUTS[name]), check_layout, LAYOUTS[name], "full")
       for name in RECOMPUTED_LAYOUTS},
    **{(name, "none"): (world_of(layout), check_layout, layout)
       for name, layout in EIGHT_PROCESS_LAYOUTS.items()},
    "fsdp_bf16_autocast": (2, check_fsdp_bf16_autocast)})
