"""The error metric and the pass criteria of gdn-verify, and the fixed batch (no processes)."""
import math

import pytest
import torch

from gdn_parallel.verify.batches import LAYOUT_KINDS, document_boundaries, replica_share, verification_batch
from gdn_parallel.verify.compare import (
    BF16_RATIO,
    NOISE_EPS,
    QUANTITIES,
    REFERENCE_EPS,
    Criteria,
    measure_steps,
    merge_rank_diffs,
    relative_error,
    scalar_error,
    set_error,
    tensor_diff,
)


def test_relative_error_is_the_norm_of_the_difference_over_the_norm_of_the_reference():
    expected = torch.tensor([3.0, 4.0])
    assert relative_error(torch.tensor([3.0, 4.5]), expected) == pytest.approx(0.1)
    assert relative_error(expected, expected) == 0.0
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.tensor([0.5, 0.0]), torch.zeros(2)) == pytest.approx(0.5)   # absolute
    assert scalar_error(2.0, -4.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(torch.zeros(2), torch.zeros(3))


def test_relative_error_is_computed_in_float64():
    expected = torch.full((1000,), 1.0, dtype=torch.float32)
    actual = expected + 1e-7 * torch.arange(1000, dtype=torch.float32) / 1000
    exact = (actual.double() - expected.double()).norm() / expected.double().norm()
    assert relative_error(actual, expected) == pytest.approx(exact.item(), rel=1e-12)


def test_set_error_worst_tensor_and_whole_set():
    expected = {"a": torch.ones(4), "b": 2 * torch.ones(4)}
    actual = {"a": torch.ones(4) * 1.01, "b": 2 * torch.ones(4)}
    err = set_error({n: tensor_diff(actual[n], expected[n], n) for n in expected})
    assert err.worst_name == "a" and err.worst == pytest.approx(0.01)
    assert err.whole == pytest.approx(0.01 * 2 / math.sqrt(4 + 16))
    assert err.noise_judged == []


def test_a_reference_at_rounding_level_is_measured_against_its_set():
    """A gradient that is zero in exact arithmetic holds rounding noise: judged against the set."""
    big = torch.ones(100)
    noise = torch.full((3,), 0.5 * NOISE_EPS * REFERENCE_EPS)          # below the noise level of `big`
    noisy_actual = -noise                                              # another rounding: opposite sign
    diffs = {"big": tensor_diff(big, big, "big"), "noise": tensor_diff(noisy_actual, noise, "noise")}
    err = set_error(diffs)
    assert err.noise_judged == ["noise"]
    assert err.worst < 1e-3                     # its own size would call it a 200 % error
    real = torch.full((3,), 10 * NOISE_EPS * REFERENCE_EPS)            # above it: a real, small gradient
    err = set_error({"big": diffs["big"], "small": tensor_diff(-real, real, "small")})
    assert err.noise_judged == [] and err.worst == pytest.approx(2.0)


def test_tensor_diff_names_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"layers.0.w: shape \(2, 3\) gathered from the layout, \(3, 2\)"):
        tensor_diff(torch.zeros(2, 3), torch.zeros(3, 2), "layers.0.w")


def test_merging_ranks_keeps_the_worst_replica_and_nan():
    merged = merge_rank_diffs([{"w": (1.0, 4.0, 1.0)}, {"w": (9.0, 4.0, 1.0), "v": (0.0, 1.0, 1.0)},
                               {"v": (float("nan"), 1.0, 1.0)}])
    assert merged["w"] == (9.0, 4.0, 1.0)
    assert math.isnan(merged["v"][0])


def test_measure_steps_reports_the_worst_step_and_missing_parameters():
    exact = {"grads": {"w": (0.0, 1.0, 1.0)}, "params": {"w": (0.0, 1.0, 1.0)}}
    off = {"grads": {"w": (1e-6, 1.0, 1.0)}, "params": {"w": (0.0, 1.0, 1.0)}}
    measured = measure_steps([{"loss": 1e-7, "grad_norm": 0.0}, {"loss": 0.0, "grad_norm": 2e-7}],
                             [exact, off], ["w", "u"])
    assert measured.errors["loss"] == 1e-7 and measured.errors["grad_norm"] == 2e-7
    assert measured.errors["grads"] == pytest.approx(1e-3) and measured.worst_names["grads"] == "w"
    assert measured.missing == ["u"]
    assert len(measured.per_step) == 2 and measured.per_step[0]["grads"] == 0.0
    with pytest.raises(ValueError, match="parameters the reference does not"):
        measure_steps([{"loss": 0.0}], [{"grads": {"x": (0.0, 1.0, 1.0)}}], ["w"])


def test_fp32_criterion():
    cpu, cuda = Criteria.for_run("fp32", "cpu"), Criteria.for_run("fp32", "cuda")
    assert cpu.bound("grads") == 1e-5 and cuda.bound("grads") == 1e-4 and cpu.bound("loss") == 1e-5
    assert cpu.failures({q: 9e-6 for q in QUANTITIES}) == []
    assert cpu.failures({"grads": 2e-5, "loss": float("nan")}) == \
        ["loss nan > 1.0e-05", "grads 2.00e-05 > 1.0e-05"]
    assert Criteria.for_run("fp32", "cpu", tolerance=1e-3).bound("params") == 1e-3


def test_bf16_criterion_is_relative_to_bf16_on_one_device():
    """tools/verify_layouts.py's rule: loss within 1e-2; gradients below 1e-2 or within 1.5x of
    the same model in bf16 on one device; the optimizer step itself stays an fp32 comparison."""
    criteria = Criteria.for_run("bf16", "cuda", baseline={"grads": 2.5e-2, "grads_all": 2e-3, "loss": 0.5})
    assert criteria.bound("loss") == 1e-2                       # never relative
    assert criteria.bound("grads") == pytest.approx(BF16_RATIO * 2.5e-2)
    assert criteria.bound("grads_all") == 1e-2                  # 1.5 x 2e-3 is below the floor
    assert criteria.bound("params") == 1e-4
    assert criteria.failures({"grads": 3.7e-2, "grads_all": 9e-3, "loss": 9e-3, "params": 0.0}) == []
    assert criteria.failures({"grads": 3.8e-2}) == ["grads 3.80e-02 > 3.8e-02"]
    with pytest.raises(ValueError, match="baseline"):
        Criteria.for_run("bf16", "cpu")


@pytest.mark.parametrize("total", [16, 48, 512, 4096])
@pytest.mark.parametrize("kind", range(LAYOUT_KINDS))
def test_document_boundaries_are_valid(total, kind):
    cu = document_boundaries(total, kind, seed=kind)
    assert cu[0] == 0 and cu[-1] == total and all(a < b for a, b in zip(cu, cu[1:]))


def test_documents_cross_shard_and_row_boundaries():
    total, seq_len = 512, 256
    cu = [document_boundaries(total, kind, seed=kind) for kind in range(LAYOUT_KINDS)]
    for cp in (2, 4, 8):
        shard = total // cp
        for boundary in range(shard, total, shard):
            crossing = [c for c in cu if not any(b == boundary for b in c)]
            assert crossing, f"no document crosses the cp={cp} boundary at {boundary}"
            ending = [c for c in cu if boundary in c]
            if cp <= 4:
                assert ending, f"no document ends on the cp={cp} boundary at {boundary}"
    assert cu[0] == [0, total]                              # one document over every boundary
    assert seq_len not in cu[1]                             # a document crosses the row boundary
    lengths = [b - a for a, b in zip(cu[1], cu[1][1:])]
    assert 1 in lengths and 2 in lengths                    # pieces of one and two tokens


def test_verification_batch_is_fixed_and_split_over_replicas():
    a = verification_batch(step=1, micro_batches=4, rows=2, seq_len=32, vocab_size=64,
                           device=torch.device("cpu"))
    b = verification_batch(step=1, micro_batches=4, rows=2, seq_len=32, vocab_size=64,
                           device=torch.device("cpu"))
    assert len(a) == 4 and all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert all(mb.input_ids.shape == (1, 64) and int(mb.input_ids.max()) < 64 for mb in a)
    assert [mb is a[i] for i, mb in zip((1, 3), replica_share(a, 1, 2))] == [True, True]
    with pytest.raises(ValueError, match="do not split over dp=3"):
        replica_share(a, 0, 3)
