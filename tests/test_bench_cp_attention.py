"""tools/bench_cp_attention.py: each rank's time of full attention under cp, contiguous against zigzag; the
summary's balance figures, and the op it times running on gloo (sdpa: the plumbing, not the speed)."""
import argparse

import pytest

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
    return {split: all(len(samples) == 2 and all(t > 0 for t in samples) for samples in kinds.values())
            and set(kinds) == {"step", "own"} for split, kinds in times.items()}


@pytest.mark.integration
def test_both_splits_run_forward_and_backward_on_every_rank():
    assert all(result == {"contiguous": True, "zigzag": True} for result in CASES("gloo"))


CASES = SharedLaunch({"gloo": (2, timed_on_gloo)})
