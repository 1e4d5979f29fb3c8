"""Fused Triton norms (gdn_kernels.norms) against the PyTorch formulas they replace.

The references are the model's own PyTorch paths (gdn_parallel.model.norm.rms_norm and
gdn_parallel.ops.gated_delta_rule.l2_normalize) run in float64, which never dispatches to Triton.
CPU runs use the interpreter on tiny shapes; the bf16 tests at training shapes need a GPU."""

import pytest
import torch
from gdn_kernels.norms import triton_l2_normalize, triton_rms_norm  # after helpers skips without triton

from gdn_parallel.model.norm import GatedRMSNorm, rms_norm
from gdn_parallel.ops.gated_delta_rule import l2_normalize
from tests.kernels.helpers import device, gpu_only, rel_err
from tests.seeds import generator

EPS = 1e-6


def _run(fn, inputs, dy):
    """fn(*inputs) and the gradients of <fn(*inputs), dy> for every input that requires grad."""
    out = fn(*inputs)
    grads = torch.autograd.grad(out, [t for t in inputs if t is not None], dy)
    return out, grads


def _leaf(t):
    return t.detach().requires_grad_(True)


def _rms_inputs(shape, dtype, gated, weight_dtype=torch.float32, dev=device, seed=0):
    gen = generator(seed, dev)
    x = torch.randn(shape, generator=gen, device=dev).to(dtype)
    x[(0,) * (len(shape) - 1)] = 0  # an all-zero row: rstd = rsqrt(eps), still finite
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen, device=dev)).to(weight_dtype)
    g = (2 * torch.randn(shape, generator=gen, device=dev)).to(dtype) if gated else None
    dy = torch.randn(shape, generator=gen, device=dev).to(dtype)
    return x, w, g, dy


def _check_rms(x, w, g, dy, tol):
    leaves = [_leaf(x), _leaf(w), None if g is None else _leaf(g)]
    out, grads = _run(lambda x, w, g: triton_rms_norm(x, w, EPS, g), leaves, dy)
    ref_leaves = [None if t is None else _leaf(t.double()) for t in leaves]
    ref, ref_grads = _run(lambda x, w, g: rms_norm(x, w, EPS, g), ref_leaves, dy.double())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, ref) < tol
    for name, got, want, like in zip(("dx", "dweight", "dgate"), grads, ref_grads, [x, w, g]):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


def _check_l2(x, dy, tol):
    out, (dx,) = _run(lambda x: triton_l2_normalize(x, EPS), [_leaf(x)], dy)
    ref, (ref_dx,) = _run(lambda x: l2_normalize(x, EPS), [_leaf(x.double())], dy.double())
    assert out.dtype == x.dtype and dx.dtype == x.dtype
    assert rel_err(out, ref) < tol and rel_err(dx, ref_dx) < tol, (rel_err(out, ref), rel_err(dx, ref_dx))


# --- interpreter (CPU) or GPU: tiny shapes --------------------------------------------------------

@pytest.mark.parametrize("hidden", [24, 100, 2048])  # odd sizes pad BLOCK_N; 2048 batches 2 rows
@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_fp32(poisoned, hidden, gated):
    # 111 rows: partial row blocks in the forward and partial dweight programs in the backward
    _check_rms(*_rms_inputs((3, 37, hidden), torch.float32, gated), tol=1e-5)


@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_fp16(poisoned, gated):
    # fp16 activations with an fp32 weight, as under mixed precision: dweight comes back fp32
    _check_rms(*_rms_inputs((2, 45, 100), torch.float16, gated), tol=5e-3)


def test_rms_norm_non_contiguous_and_expanded_grad(poisoned):
    x, w, g, _ = _rms_inputs((37, 3, 24), torch.float32, gated=True)
    x, g = x.transpose(0, 1), g.transpose(0, 1)  # [3, 37, 24] views
    x_, w_, g_ = _leaf(x), _leaf(w), _leaf(g)
    triton_rms_norm(x_, w_, EPS, g_).sum().backward()  # dy arrives as an expanded (stride 0) tensor
    ref = [_leaf(t.double()) for t in (x, w, g)]
    rms_norm(*ref[:2], EPS, ref[2]).sum().backward()
    for got, want in zip((x_, w_, g_), ref):
        assert rel_err(got.grad, want.grad) < 1e-5


def test_rms_norm_empty():
    x, w = _leaf(torch.empty(0, 24, device=device)), _leaf(torch.ones(24, device=device))
    out = triton_rms_norm(x, w, EPS)
    out.sum().backward()
    assert out.shape == (0, 24) and torch.equal(w.grad, torch.zeros(24, device=device))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
@pytest.mark.parametrize("head_dim", [16, 100, 128])
def test_l2_normalize(poisoned, dtype, tol, head_dim):
    gen = generator(1, device)
    x = torch.randn(2, 9, 3, head_dim, generator=gen, device=device)
    x[0, 0, 0] = 0
    dy = torch.randn(x.shape, generator=gen, device=device)
    _check_l2(x.to(dtype), dy.to(dtype), tol)


# --- GPU only: bf16 at training shapes ----------------------------------------------------------

@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_bf16_large(gated):
    _check_rms(*_rms_inputs((65536, 2048), torch.bfloat16, gated, weight_dtype=torch.bfloat16), tol=1e-2)


@gpu_only
@pytest.mark.gpu
def test_l2_normalize_bf16_large():
    x = torch.randn(1, 65536, 16, 128, device="cuda", dtype=torch.bfloat16)
    _check_l2(x, torch.randn_like(x), tol=1e-2)


@gpu_only
@pytest.mark.gpu
def test_gated_rms_norm_module_uses_kernel(monkeypatch):
    """The model's GatedRMSNorm on CUDA goes through the kernel and matches the float64 formula."""
    import gdn_kernels.norms as norms
    calls = []
    kernel = norms.triton_rms_norm
    monkeypatch.setattr(norms, "triton_rms_norm", lambda *a: calls.append(1) or kernel(*a))
    x, w, g, _ = _rms_inputs((2, 512, 16, 128), torch.bfloat16, gated=True)
    norm = GatedRMSNorm(128, eps=EPS).cuda()
    norm.weight.data.copy_(w)
    out = norm(x, g)
    assert calls and rel_err(out, rms_norm(x.double(), w.double(), EPS, g.double())) < 1e-2


@gpu_only
@pytest.mark.gpu
def test_norms_deterministic():
    x, w, g, dy = _rms_inputs((65536, 2048), torch.bfloat16, gated=True)
    runs = [_run(lambda x, w, g: triton_rms_norm(x, w, EPS, g), [_leaf(x), _leaf(w), _leaf(g)], dy)
            for _ in range(2)]
    (out0, grads0), (out1, grads1) = runs
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    q = torch.randn(1, 65536, 16, 128, device="cuda", dtype=torch.bfloat16)
    a, b = (_run(lambda q: triton_l2_normalize(q, EPS), [_leaf(q)], torch.ones_like(q)) for _ in range(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][0], b[1][0])
