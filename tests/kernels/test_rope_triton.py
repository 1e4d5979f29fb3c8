"""Fused Triton RoPE against the PyTorch formula: output and the gradient of x.

On CPU the kernel runs in Triton's interpreter (fp32/fp16, tiny shapes); bf16 at training size and
positions near 1M (where the angle's range reduction matters) need a GPU.
"""
import importlib

import pytest
import torch

from gdn_parallel.ops import rope as rope_ops
from tests.seeds import generator

from .helpers import device, gpu_only, rel_err  # skips the module without triton

kernel = importlib.import_module("gdn_kernels.rope")  # after helpers: it imports triton


def _compare(shape, positions, dtype, theta, tol):
    B, T, H, D = shape
    g = generator(1)
    x = torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(*shape, generator=g).to(device, dtype)
    inv_freq = theta ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    got = kernel.triton_rotary(x, positions.to(device), inv_freq)
    (dx,) = torch.autograd.grad(got, x, dy)
    ref_x = x.detach().float().requires_grad_()
    ref = rope_ops.apply_rotary(ref_x, positions.to(device), theta, impl="torch")
    (ref_dx,) = torch.autograd.grad(ref, ref_x, dy.float())
    assert got.dtype == dtype and dx.dtype == dtype and got.shape == x.shape
    assert rel_err(got, ref) < tol, rel_err(got, ref)
    assert rel_err(dx, ref_dx) < tol, rel_err(dx, ref_dx)
    return got, dx


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_matches_torch(dtype, tol):
    g = generator(0)
    _compare((2, 9, 3, 8), torch.randint(0, 60, (2, 9), generator=g), dtype, 10000.0, tol)  # per row
    _compare((3, 5, 2, 6), torch.arange(5).unsqueeze(0), dtype, 500.0, tol)  # shared, head dim 6


def test_positions_far_along_a_long_sequence():
    """Angles of up to 1e7 radians: the kernel takes off whole turns before cos and sin (in fp64, see
    _within_half_turn); the rotation must stay that of the fp32 angle, to fp32's rounding."""
    far = torch.tensor([[0, 99_999, 262_143, 524_289, 786_431, 1_048_575, 4_194_303, 16_777_215]])
    _compare((1, 8, 2, 128), far, torch.float32, 10000.0, 2e-6)
    _compare((1, 8, 2, 64), far, torch.float32, 500.0, 2e-6)


def test_rows_past_the_last_block_and_empty():
    _compare((1, 7, 5, 4), torch.tensor([[0, 1, 2, 0, 1, 0, 1]]), torch.float32, 10000.0, 1e-6)
    x = torch.zeros(1, 0, 2, 4, device=device)
    assert kernel.triton_rotary(x, torch.zeros(1, 0, dtype=torch.long, device=device),
                                torch.ones(2, device=device)).shape == x.shape


def test_the_backward_undoes_the_forward():
    """The rotation is orthogonal: rotating the output back (the backward's map) returns x."""
    g = generator(2)
    x = torch.randn(2, 6, 2, 8, generator=g).to(device)
    positions = torch.randint(0, 1000, (2, 6), generator=g).to(device)
    inv_freq = 10000.0 ** (-torch.arange(0, 8, 2, device=device, dtype=torch.float32) / 8)
    back = kernel._rotate(kernel._rotate(x, positions, inv_freq, 1), positions, inv_freq, -1)
    assert rel_err(back, x) < 1e-6


@gpu_only
@pytest.mark.gpu
def test_bf16_training_size_long_positions_and_model_dispatch():
    B, T, H, D = 2, 4096, 16, 128
    positions = torch.arange(T).unsqueeze(0) + 1_000_000 - T  # near the end of a 1M-token sequence
    _compare((B, T, H, D), positions, torch.float32, 10000.0, 2e-6)   # libdevice's cos after the turns
    got, dx = _compare((B, T, H, D), positions, torch.bfloat16, 10000.0, 1e-2)
    again, dx_again = _compare((B, T, H, D), positions, torch.bfloat16, 10000.0, 1e-2)
    assert torch.equal(got, again) and torch.equal(dx, dx_again)
    calls = []
    original = kernel.triton_rotary
    kernel.triton_rotary = lambda *args: calls.append(1) or original(*args)
    try:
        rope_ops.apply_rotary(torch.randn(1, 8, 2, 4, device="cuda", dtype=torch.bfloat16), torch.arange(8))
    finally:
        kernel.triton_rotary = original
    assert calls, "apply_rotary on CUDA did not use the kernel"
