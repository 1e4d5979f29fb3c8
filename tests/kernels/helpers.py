"""Shared pieces of the kernel tests: skip markers and the relative-error metric."""
import pytest
import torch

triton = pytest.importorskip("triton")

on_gpu = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (bf16 kernels; CPU runs the interpreter)")
device = "cuda" if on_gpu else "cpu"
# fp32 inputs through tl.dot: IEEE products in the CPU interpreter, but on CUDA Triton takes fp32 dot
# operands as TF32 (10-bit mantissa) by default, so there these tests hold the GPU criterion instead.
FP32_DOT_TOL = 1e-2 if on_gpu else 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64 (0 when both are 0)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom
