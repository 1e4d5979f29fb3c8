"""Comparisons of computed tensors with references that tell a real quantity from rounding noise.

A tensor's error is measured against its own size (max |a - e| / max |e|, or with norms) whenever
its reference is a real quantity. A reference that is zero in exact arithmetic (the query and key
gradients under a one-token window, an input the loss does not depend on) holds only rounding
noise; two correct computations disagree in that noise completely, so its own size is no
yardstick. Such a reference is *degenerate*: at most NOISE_EPS machine epsilons of its dtype times
the size of the set it is compared in (e.g. all gradients of one backward), and it is checked as a
near-zero: its error is measured against the set's size instead.
"""
from __future__ import annotations

import math

import torch

# The degeneracy threshold, in epsilons of the reference's dtype times its set's size (float64:
# 2.2e-12, float32: 1.2e-3). Measured over the suite with two seed sets: zero-in-exact-arithmetic
# references hold at most 2.5 eps (window-1 attention dq, dk); two correct runs of a real tensor
# differ by up to 3.7e3 eps (model gradients under pp x tp), about the noise that a zero result of
# so deep a computation would hold. Real references are at least 6e11 eps of their set in the
# float64 tests (the key bias under RoPE), 4e5 eps in the float32 ones (CP gradients).
NOISE_EPS = 1e4
METRICS = ("max", "l2")   # largest element (float64 equivalence tests) or Frobenius norm (kernels)


def size(t, metric: str = "max") -> float:
    t = torch.as_tensor(t).detach().double()
    if t.numel() == 0:
        return 0.0
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: expected one of {METRICS}")
    return (t.abs().max() if metric == "max" else t.norm()).item()


def set_size(tensors, metric: str = "max") -> float:
    """The size one tensor holding all of `tensors` would have."""
    sizes = [size(t, metric) for t in tensors]
    return max(sizes, default=0.0) if metric == "max" else math.hypot(*sizes)


def is_degenerate(expected, scale: float, metric: str = "max") -> bool:
    """Whether `expected` is rounding noise against `scale`, the size of the set it belongs to."""
    expected = torch.as_tensor(expected)
    if torch.finfo(expected.dtype).bits < 32:   # NOISE_EPS of bf16/fp16 would call everything noise
        raise ValueError(f"a {expected.dtype} reference: compute references in float32 or float64")
    return size(expected, metric) <= NOISE_EPS * torch.finfo(expected.dtype).eps * scale


def rel_err(actual, expected, scale: float | None = None, metric: str = "max") -> float:
    """|actual - expected| relative to |expected|, in float64. Given `scale` (the size of the set
    `expected` is compared in), a degenerate reference is measured against `scale` instead. Without
    one, an all-zero reference gives the absolute error."""
    diff = size(torch.as_tensor(actual).double() - torch.as_tensor(expected).double(), metric)
    yardstick = size(expected, metric)
    if scale is not None and is_degenerate(expected, scale, metric):
        yardstick = scale
    return diff / yardstick if yardstick > 0 else diff


def assert_close_set(actuals: dict, expecteds: dict, tol: float, context: str = "", metric: str = "max"):
    """Every actuals[name] within `tol` of expecteds[name]: relative to the reference's own size, or,
    where the reference is degenerate, to the size of all of `expecteds` together."""
    assert actuals.keys() == expecteds.keys(), (sorted(actuals), sorted(expecteds), context)
    scale = set_size(expecteds.values(), metric)
    for name, expected in expecteds.items():
        actual = actuals[name]
        shapes = tuple(actual.shape), tuple(expected.shape)
        assert shapes[0] == shapes[1], f"{name}: shape {shapes[0]} != {shapes[1]} ({context})"
        err = rel_err(actual, expected, scale, metric)
        noise = is_degenerate(expected, scale, metric)
        against = "the set's size (its reference is rounding noise)" if noise else "its own size"
        assert err < tol, f"{name}: error {err:.3g} relative to {against} >= {tol} ({context})"
