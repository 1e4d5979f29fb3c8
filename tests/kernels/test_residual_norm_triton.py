"""triton_residual_rms_norm (a block's norm that also passes the residual stream on) against its
formula, gdn_parallel.model.norm.residual_rms_norm in float64 through autograd: the stream h, the
norm's output and the gradients of x, the branch and the weight, with h's own gradient (the stream's
later uses) present or absent and the norm's output used or not. The interpreter runs tiny shapes
on CPU; bf16 at training shapes needs a GPU."""

import pytest
import torch
from gdn_kernels.norms import triton_residual_rms_norm  # after helpers skips without triton

from gdn_parallel.model.norm import residual_rms_norm
from tests.kernels.helpers import device, gpu_only, rel_err
from tests.seeds import generator

EPS = 1e-6


def _inputs(shape, x_dtype, branch_dtype, with_branch, seed, dev=device):
    gen = generator(seed, dev)
    x = torch.randn(shape, generator=gen, device=dev)
    branch = torch.randn(shape, generator=gen, device=dev) if with_branch else None
    if with_branch:
        x[(0,) * (len(shape) - 1)] = -branch[(0,) * (len(shape) - 1)].to(branch_dtype).float()  # h = 0
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=gen, device=dev)
    dh = torch.randn(shape, generator=gen, device=dev)
    dy = torch.randn(shape, generator=gen, device=dev)
    return (x.to(x_dtype), None if branch is None else branch.to(branch_dtype), weight,
            dh.to(x_dtype), dy.to(branch_dtype))


def _run(fn, x, branch, weight, dh, dy, use_h, use_y):
    leaves = [None if t is None else t.detach().requires_grad_() for t in (x, branch, weight)]
    h, y = fn(*leaves)
    outputs, grads = zip(*[pair for pair, used in (((h, dh), use_h), ((y, dy), use_y)) if used])
    torch.autograd.backward(list(outputs), list(grads))
    x_, branch_, weight_ = leaves
    return {"h": h.detach(), "y": y.detach(), "dx": x_.grad,
            "dbranch": None if branch_ is None else branch_.grad, "dweight": weight_.grad}


def _check(inputs, out_dtype, use_h, use_y, tol):
    x, branch, weight, dh, dy = inputs
    got = _run(lambda x, b, w: triton_residual_rms_norm(x, b, w, EPS, out_dtype), *inputs, use_h, use_y)
    want = _run(lambda x, b, w: residual_rms_norm(x, b, w, EPS),
                *[None if t is None else t.double() for t in inputs], use_h, use_y)
    likes = {"h": x, "y": dy, "dx": x, "dbranch": branch, "dweight": weight}
    for name, like in likes.items():
        if want[name] is None:
            assert got[name] is None, name
            continue
        if name == "dweight" and not use_y:  # the weight does not reach h: no gradient either way
            assert got[name] is None or not got[name].any(), name
            continue
        assert got[name].dtype == like.dtype and got[name].shape == like.shape, name
        assert rel_err(got[name], want[name]) < tol, (name, rel_err(got[name], want[name]))


@pytest.mark.parametrize("hidden", [24, 100])
@pytest.mark.parametrize("with_branch", [False, True])
@pytest.mark.parametrize("use_h,use_y", [(True, True), (False, True), (True, False)])
def test_matches_formula_fp32(poisoned, hidden, with_branch, use_h, use_y):
    # 111 rows: partial row blocks in the forward and partial dweight programs in the backward
    inputs = _inputs((3, 37, hidden), torch.float32, torch.float32, with_branch, seed=hidden)
    _check(inputs, None, use_h, use_y, tol=1e-5)


@pytest.mark.parametrize("with_branch", [False, True])
def test_half_branch_and_output_over_an_fp32_stream(poisoned, with_branch):
    """As under autocast: an fp32 residual stream, a half-precision branch (a layer's output) and
    norm output; h and dx come back fp32, the branch's gradient in its own dtype."""
    inputs = _inputs((2, 45, 100), torch.float32, torch.float16, with_branch, seed=7)
    _check(inputs, torch.float16, True, True, tol=5e-3)


@pytest.mark.parametrize("with_branch", [False, True])
def test_a_half_stream(poisoned, with_branch):
    """model.residual_in_fp32=false: the stream, the branch and the norm output all half precision."""
    inputs = _inputs((2, 45, 100), torch.float16, torch.float16, with_branch, seed=9)
    _check(inputs, None, True, True, tol=5e-3)


def test_the_stream_passes_through_unchanged_without_a_branch():
    x, _, weight, _, _ = _inputs((5, 24), torch.float32, torch.float32, False, seed=3)
    h, _ = triton_residual_rms_norm(x, None, weight, EPS)
    assert torch.equal(h, x)


def test_shape_mismatch_is_named():
    x = torch.zeros(4, 24, device=device)
    with pytest.raises(ValueError, match="branch shape"):
        triton_residual_rms_norm(x, torch.zeros(4, 12, device=device), torch.ones(24, device=device), EPS)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("with_branch", [False, True])
def test_bf16_branch_at_training_shape(with_branch):
    inputs = _inputs((65536, 2048), torch.float32, torch.bfloat16, with_branch, seed=11)
    _check(inputs, torch.bfloat16, True, True, tol=1e-2)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("with_branch", [False, True])
def test_bf16_stream_at_training_shape(with_branch):
    inputs = _inputs((65536, 2048), torch.bfloat16, torch.bfloat16, with_branch, seed=12)
    _check(inputs, None, True, True, tol=1e-2)


@gpu_only
@pytest.mark.gpu
def test_block_norms_use_the_kernel(monkeypatch):
    """The model's ResidualRMSNorm on CUDA goes through the kernel."""
    import gdn_kernels.norms as norms

    from gdn_parallel.model.norm import ResidualRMSNorm
    calls = []
    kernel = norms.triton_residual_rms_norm
    monkeypatch.setattr(norms, "triton_residual_rms_norm", lambda *a: calls.append(1) or kernel(*a))
    x, branch, weight, _, _ = _inputs((2, 512, 1024), torch.float32, torch.bfloat16, True, seed=5)
    norm = ResidualRMSNorm(1024, eps=EPS).cuda()
    norm.weight.data.copy_(weight)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h, y = norm(x, branch)
    want_h, want_y = residual_rms_norm(x.double(), branch.double(), weight.double(), EPS)
    assert calls and y.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert rel_err(h, want_h) < 1e-6 and rel_err(y, want_y) < 1e-2
