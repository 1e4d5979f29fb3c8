"""The shared comparison: own-size errors for real references, set-size errors for rounding noise."""
import pytest
import torch

from tests.compare import NOISE_EPS, assert_close_set, is_degenerate, rel_err, set_size
from tests.seeds import generator

EPS64 = torch.finfo(torch.float64).eps


def gradients(seed=0):
    gen = generator(seed)
    real = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    noise = torch.randn(4, 5, generator=gen, dtype=torch.float64) * EPS64   # zero in exact arithmetic
    return {"dv": real, "dq": noise}


def test_noise_reference_is_checked_against_the_set():
    expected = gradients()
    scale = set_size(expected.values())
    assert is_degenerate(expected["dq"], scale) and not is_degenerate(expected["dv"], scale)
    other_noise = {"dv": expected["dv"] * (1 + 1e-14), "dq": -expected["dq"]}
    assert rel_err(other_noise["dq"], expected["dq"]) > 1               # its own size: no yardstick
    assert_close_set(other_noise, expected, 1e-12)
    with pytest.raises(AssertionError, match="dq: .* the set's size"):   # a real value where zero is due
        assert_close_set({**other_noise, "dq": expected["dv"] * 1e-6}, expected, 1e-12)


def test_real_reference_keeps_its_own_bound():
    expected = gradients()
    small = expected["dv"] * 2 * NOISE_EPS * EPS64          # small against the set, but not noise
    expected["small"] = small
    actual = {**expected, "small": small * (1 + 1e-6)}
    assert not is_degenerate(small, set_size(expected.values()))
    with pytest.raises(AssertionError, match="small: .* its own size"):
        assert_close_set(actual, expected, 1e-9)


def test_l2_metric_and_zero_set():
    expected = gradients()
    scale = set_size(expected.values(), "l2")
    assert scale == pytest.approx(torch.cat([t.flatten() for t in expected.values()]).norm().item())
    assert rel_err(expected["dv"] * 1.001, expected["dv"], scale, "l2") == pytest.approx(1e-3)
    zeros = torch.zeros(3, dtype=torch.float64)
    assert rel_err(zeros + 0.5, zeros) == 0.5                         # all zero, no set: absolute
    with pytest.raises(AssertionError, match="shape"):
        assert_close_set({"x": zeros}, {"x": zeros[:2]}, 1e-9)
