"""Shared pieces of the kernel tests: skip markers and the relative-error metric."""
import pytest
import torch

triton = pytest.importorskip("triton")

on_gpu = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (bf16 kernels; CPU runs the interpreter)")
device = "cuda" if on_gpu else "cpu"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64 (0 when both are 0)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom
