"""Fused SwiGLU elementwise kernels (gdn_kernels.swiglu) and swiglu_down on them, against the
autograd oracle `swiglu_down_reference` (and F.silu(gate) * up) on the same inputs in fp32.

CPU runs use Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at tiny shapes in
fp32 and fp16 (the interpreter's bf16 is unreliable); the bf16 tests at a training shape need a GPU."""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import gdn_parallel.ops.swiglu as ops_swiglu
from gdn_parallel.ops.swiglu import swiglu_down, swiglu_down_reference
from tests.compare import set_size
from tests.kernels.helpers import device, gpu_only, rel_err  # skips the module without triton
from tests.seeds import generator

kernels = importlib.import_module("gdn_kernels.swiglu")  # after helpers: it imports triton


@pytest.fixture
def on_kernels(monkeypatch):
    """swiglu_down dispatches to the kernels here too (the interpreter on CPU); counts their calls."""
    calls = []
    for name in ("silu_mul", "silu_mul_backward"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    monkeypatch.setattr(ops_swiglu, "auto_uses_triton", lambda x, name: name == "swiglu")
    return calls


def _inputs(shape, dtype, out_features=8, weight_dtype=torch.float32, dev=device, seed=0):
    gen = generator(seed, dev)
    gate = 3 * torch.randn(shape, generator=gen, device=dev)
    gate.view(-1)[:2] = torch.tensor([30.0, -30.0])  # silu's tails: s -> 1 and s -> 0
    up = torch.randn(shape, generator=gen, device=dev)
    weight = torch.randn(out_features, shape[-1], generator=gen, device=dev) / math.sqrt(shape[-1])
    dout = torch.randn(*shape[:-1], out_features, generator=gen, device=dev)
    return gate.to(dtype), up.to(dtype), weight.to(weight_dtype), dout.to(dtype)


def _grads(fn, gate, up, weight, dout):
    """fn's output and the gradients of <fn(gate, up, weight), dout>."""
    leaves = [t.detach().clone().requires_grad_() for t in (gate, up, weight)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    return {"out": out.detach(), "dgate": grads[0], "dup": grads[1], "dweight": grads[2]}


def _check(got, want, tol, like):
    scale = set_size(want.values(), "l2")
    for name, value in got.items():
        assert value.shape == want[name].shape and value.dtype == like[name], name
        assert torch.isfinite(value).all(), name
        assert rel_err(value, want[name], scale) < tol, (name, rel_err(value, want[name], scale))


def _elementwise_reference(gate, up, dp):
    """p = silu(gate) * up and its (dgate, dup) through autograd, in fp32."""
    g, u = (t.detach().float().requires_grad_() for t in (gate, up))
    p = F.silu(g) * u
    dgate, dup = torch.autograd.grad(p, (g, u), dp.float())
    return p.detach(), dgate, dup


# --- interpreter (CPU) or GPU: tiny shapes --------------------------------------------------------

SHAPES = [(3, 37), (2, 5, 300)]  # 111 elements: one partial block; 3000: a full block and a partial one


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_kernels_match_formula(poisoned, shape, dtype, tol):
    gate, up, _, _ = _inputs(shape, dtype)
    dp = torch.randn(shape, generator=generator(1, device), device=device).to(dtype)
    p = kernels.silu_mul(gate, up)
    dgate, dup = kernels.silu_mul_backward(dp, gate, up)
    want = _elementwise_reference(gate, up, dp)
    for name, got, ref in zip(("p", "dgate", "dup"), (p, dgate, dup), want):
        assert got.dtype == dtype and got.shape == gate.shape, name
        assert rel_err(got, ref) < tol, (name, rel_err(got, ref))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_with_the_product_over_dp(poisoned, shape, dtype):
    """with_product writes p as silu_mul does (the same bits), and overwrite_dp puts dgate in dp's
    memory with the values of a separate output."""
    gate, up, _, _ = _inputs(shape, dtype)
    dp = torch.randn(shape, generator=generator(2, device), device=device).to(dtype)
    dgate, dup = kernels.silu_mul_backward(dp, gate, up)
    scratch = dp.clone()
    dgate2, dup2, p = kernels.silu_mul_backward(scratch, gate, up, with_product=True, overwrite_dp=True)
    assert dgate2.data_ptr() == scratch.data_ptr()
    assert torch.equal(dgate2, dgate) and torch.equal(dup2, dup)
    assert torch.equal(p, kernels.silu_mul(gate, up))
    with pytest.raises(ValueError, match="contiguous dp"):
        kernels.silu_mul_backward(dp.mT, gate.mT, up.mT, overwrite_dp=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_down_on_kernels_fp32(poisoned, on_kernels, shape):
    gate, up, weight, dout = _inputs(shape, torch.float32)
    got = _grads(swiglu_down, gate, up, weight, dout)
    want = _grads(swiglu_down_reference, gate, up, weight, dout)
    assert on_kernels == ["silu_mul", "silu_mul_backward"]  # forward; dgate, dup and p for dweight
    _check(got, want, 1e-5, {k: torch.float32 for k in want})


def test_swiglu_down_on_kernels_fp16_fp32_weight(poisoned, on_kernels):
    """As under autocast: half activations, an fp32 master weight whose gradient stays fp32."""
    gate, up, weight, dout = _inputs((2, 45, 100), torch.float16, out_features=24)
    got = _grads(swiglu_down, gate, up, weight, dout)
    want = _grads(swiglu_down_reference, gate.float(), up.float(), weight, dout.float())
    assert on_kernels
    half = torch.float16
    _check(got, want, 5e-3, {"out": half, "dgate": half, "dup": half, "dweight": torch.float32})


def test_empty(on_kernels):
    gate, up = (torch.empty(0, 37, device=device) for _ in range(2))
    assert kernels.silu_mul(gate, up).shape == (0, 37)
    assert [t.shape for t in kernels.silu_mul_backward(gate, gate, up)] == [(0, 37), (0, 37)]
    weight = torch.randn(5, 37, device=device)
    got = _grads(swiglu_down, gate, up, weight, torch.empty(0, 5, device=device))
    assert got["out"].shape == (0, 5) and torch.equal(got["dweight"], torch.zeros_like(weight))


def test_kernels_reject_mismatched_inputs():
    with pytest.raises(ValueError, match="shape and dtype"):
        kernels.silu_mul(torch.zeros(2, 4, device=device), torch.zeros(2, 5, device=device))
    with pytest.raises(ValueError, match="shape and dtype"):
        z = torch.zeros(2, 4, device=device)
        kernels.silu_mul_backward(z, z, z.half())


# --- GPU only: bf16 at a training shape ------------------------------------------------------------

LARGE = (4 * 4096, 5376)  # tokens of a micro-batch x the MLP's intermediate size


@gpu_only
@pytest.mark.gpu
def test_kernels_bf16_large():
    gate, up, _, _ = _inputs(LARGE, torch.bfloat16)
    dp = torch.randn(LARGE, device="cuda", dtype=torch.bfloat16)
    got = (kernels.silu_mul(gate, up), *kernels.silu_mul_backward(dp, gate, up))
    for name, value, ref in zip(("p", "dgate", "dup"), got, _elementwise_reference(gate, up, dp)):
        assert value.dtype == torch.bfloat16 and rel_err(value, ref) < 1e-2, (name, rel_err(value, ref))
    again = (kernels.silu_mul(gate, up), *kernels.silu_mul_backward(dp, gate, up))
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@gpu_only
@pytest.mark.gpu
def test_swiglu_down_bf16_large(monkeypatch):
    """swiglu_down on CUDA takes the kernels; bf16 activations with an fp32 weight (autocast's case)
    against the fp32 oracle on the same values, and the same bits twice."""
    calls = []
    kernel = kernels.silu_mul_backward
    monkeypatch.setattr(kernels, "silu_mul_backward", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    gate, up, weight, dout = _inputs(LARGE, torch.bfloat16, out_features=2048)
    got = _grads(swiglu_down, gate, up, weight, dout)
    assert calls
    want = _grads(swiglu_down_reference, gate.float(), up.float(), weight, dout.float())
    bf16 = torch.bfloat16
    _check(got, want, 1e-2, {"out": bf16, "dgate": bf16, "dup": bf16, "dweight": torch.float32})
    del want
    again = _grads(swiglu_down, gate, up, weight, dout)
    assert all(torch.equal(got[k], again[k]) for k in got)
