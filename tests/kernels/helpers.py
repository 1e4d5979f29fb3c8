"""Shared pieces of the kernel tests: skip markers and the relative-error metric."""
import pytest
import torch

from tests import compare

triton = pytest.importorskip("triton")

on_gpu = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (bf16 kernels; CPU runs the interpreter)")
device = "cuda" if on_gpu else "cpu"


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: float = None) -> float:
    """||a - e|| / ||e|| in float64. A reference that is zero in exact arithmetic holds only rounding
    noise, no yardstick: given `scale` (the norm of all the references it is compared with, e.g.
    compare.set_size(grads, "l2")), such a reference's error is ||a - e|| / scale; without one, an
    all-zero reference gives ||a - e||. See tests/compare.py."""
    return compare.rel_err(actual, expected, scale, metric="l2")
