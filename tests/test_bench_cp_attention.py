"""tools/bench_cp_attention.py: each rank's time of full attention under cp, contiguous against zigzag; the
summary's balance figures, and the op it times running on gloo (sdpa: the plumbing, not the speed)."""
import argparse
import json

import pytest
import torch
import torch.distributed as dist

from gdn_parallel.comm import CPContext
from gdn_parallel.ops.attention.cp import full_attention_positions
from tests.parallel.launcher import SharedLaunch
from tools import bench_cp_attention


def test_balance_is_the_slowest_rank_own_work_over_the_mean():
    samples = [{"contiguous": {"step": [5.0, 5.1, 5.0], "own": [1.0, 1.2, 1.0]},
                "zigzag": {"step": [3.0, 3.0, 3.1], "own": [2.0, 2.0, 2.1]}},
               {"contiguous": {"step": [5.0, 5.0, 5.2], "own": [3.0, 3.0, 3.2]},
                "zigzag": {"step": [3.0, 3.2, 3.0], "own": [2.0, 2.2, 2.0]}}]
    report = bench_cp_attention.summarize(samples)
    assert report["contiguous"]["own_ms_per_rank"] == [1.0, 3.0]
    assert report["contiguous"]["own_slowest_over_mean"] == pytest.approx(1.5)
    assert report["zigzag"]["own_slowest_over_mean"] == pytest.approx(1.0)
    assert report["zigzag"]["step_slowest_ms"] == 3.0
    assert "| zigzag | 3.00 | 2.00, 2.00 | 1.000 |" in bench_cp_attention.table(report)


def timed_on_gloo(rank, world):
    args = argparse.Namespace(tokens_per_rank=64, heads=2, kv_heads=1, head_dim=8, docs=2, warmup=1, iters=2,
                              device="cpu")
    times = bench_cp_attention.measure(rank, world, args)
    ran = {split: all(len(samples) == 2 and all(t > 0 for t in samples) for samples in kinds.values())
           and set(kinds) == {"step", "own"} for split, kinds in times.items()}
    return ran, {split: _laid_out_as_the_op_runs(rank, world, split) for split in bench_cp_attention.SPLITS}


def _laid_out_as_the_op_runs(rank, world, split) -> bool:
    """--ranks lays out each rank's work with no message: is it the mask and shapes the op under cp
    gives this rank's own attention (documents of 24, 40, 40, 24 tokens over ranks of 32)?"""
    cu = [0, 24, 64, 104, 128]
    cp = CPContext.build(dist.group.WORLD, cu, 128 // world, attention_split=split)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 128 // world, heads, 8, generator=gen) for heads in (2, 1, 1))
    captured = bench_cp_attention._own_work_inputs(q, k, v, cp, "sdpa", {})
    alone = CPContext.build(None, cu, 128 // world, rank=rank, size=world, attention_split=split)
    laid_out = full_attention_positions(alone, torch.device("cpu"))
    names = ("q_index", "q_doc", "k_index", "k_doc")
    return (all(torch.equal(captured["kwargs"][name], mine) for name, mine in zip(names, laid_out))
            and captured["q"].shape[1] == laid_out[0].shape[0] and captured["k"].shape[1] == 128)


@pytest.mark.integration
def test_both_splits_run_forward_and_backward_on_every_rank():
    assert all(ran == {"contiguous": True, "zigzag": True} for ran, _ in CASES("gloo"))


@pytest.mark.integration
def test_one_device_lays_out_every_rank_as_the_op_under_cp_does():
    assert all(laid_out == {"contiguous": True, "zigzag": True} for _, laid_out in CASES("gloo"))


def test_ranks_in_turn_times_every_rank_own_work_on_one_device(tmp_path):
    argv = ["--ranks", "4", "--tokens-per-rank", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
            "--docs", "2", "--warmup", "1", "--iters", "2", "--device", "cpu", "--out", str(tmp_path)]
    assert bench_cp_attention.main(argv) == 0
    written = json.loads((tmp_path / "cp_attention.json").read_text())
    assert written["world"] == 4 and written["mode"] == "ranks in turn on one device"
    for split in bench_cp_attention.SPLITS:
        assert all(len(rank[split]["own"]) == 2 for rank in written["samples"])
        assert len(written["report"][split]["own_ms_per_rank"]) == 4
        assert "step_slowest_ms" not in written["report"][split]


CASES = SharedLaunch({"gloo": (2, timed_on_gloo)})
