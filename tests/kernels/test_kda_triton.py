"""Triton Kimi Delta Attention (gdn_kernels.kda, through kimi_delta_attention(impl="triton")) against
the float64 token-loop oracle: outputs, final states and the gradients of q, k, v, g, beta and the
initial states, on fresh random inputs whose decays are strong enough to matter (a third of the
channels forget at up to g = -5 per token, past exp's range over a chunk if the kernels ever wrote
exp(-G)). On CPU the kernels run in Triton's interpreter (fp32 and fp16, tiny shapes: a few chunks
cost it seconds); the GPU tests cover bf16 and the head sizes 64, 128 and 256."""
import functools

import gdn_kernels.kda as kda_triton  # noqa: E402  (after helpers: needs triton)
import pytest
import torch

from gdn_parallel.ops.kda import kimi_delta_attention
from tests.kernels.helpers import device, gpu_only, rel_err
from tests.ops.kda_inputs import kda_inputs
from tests.seeds import generator

NAMES = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def strong_decay_inputs(B, T, H, HV, K, V, *, seed, num_states):
    """kda_inputs (fp32, unit-norm keys, most decays near 0) with every third key channel forgetting
    fast: g uniform in (-5, 0] there, a chunk's cumulative decay reaching about -160."""
    q, k, v, g, beta, h0 = kda_inputs(B, T, H, HV, K, V, dtype=torch.float32, seed=seed,
                                      num_states=num_states, requires_grad=False)
    forgetting = -5.0 * torch.rand(g.shape, generator=generator(seed + 1))
    g = torch.where(torch.arange(K) % 3 == 0, forgetting, g)
    return [q, k, v, g, beta, h0]


def run(inputs, impl, dtype, cu_seqlens=None, with_state=True):
    """Outputs and every gradient of a random linear loss on o and the final states."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(device, dtype if i < 5 else state_dtype).requires_grad_()
              for i, x in enumerate(inputs)]
    q, k, v, g, beta, h0 = leaves
    o, final = kimi_delta_attention(q, k, v, g, beta, initial_state=h0 if with_state else None,
                                    output_final_state=True, cu_seqlens=cu_seqlens, impl=impl)
    gen = generator(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    leaves = leaves if with_state else leaves[:5]
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), leaves)
    return [o, final, *grads]


def assert_close(actual, expected, tol):
    for name, a, e in zip(NAMES, actual, expected):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = rel_err(a.detach().cpu(), e.detach().cpu())
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


# Two documents: one shorter than a chunk, one of two chunks and two tokens; grouped value heads.
DOCS = [0, 40, 170]


@functools.cache
def documents_case():
    """(inputs, cu_seqlens, the oracle's results), shared by the CPU tests."""
    cu = torch.tensor(DOCS)
    inputs = strong_decay_inputs(1, DOCS[-1], 1, 2, 16, 48, seed=31, num_states=len(DOCS) - 1)
    return inputs, cu, run(inputs, "naive", torch.float64, cu)


def test_fp32_documents_match_oracle(monkeypatch):
    """K = 16 (masked key columns), V = 48 (two value blocks of the walk, one partly masked); every
    kernel output starts as NaN, so an element the kernels skip shows up."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(kda_triton, "_buffer", poisoned)
    inputs, cu, expected = documents_case()
    assert_close(run(inputs, "triton", torch.float32, cu), expected, 1e-5)


def test_fp16_batch_without_initial_state_matches_oracle():
    """A plain batch of two sequences (no cu_seqlens), no initial state, fp16 operands."""
    inputs = strong_decay_inputs(2, 70, 1, 1, 32, 32, seed=32, num_states=2)
    expected = run(inputs, "naive", torch.float64, with_state=False)
    assert_close(run(inputs, "triton", torch.float16, with_state=False), expected, 2e-2)


def test_blocks_that_forget_too_fast_for_the_midpoint_factors_are_summed_exactly():
    """A diagonal 16-token block factors through its midpoint decay only while every channel's decay
    over it stays within FACTORED_RANGE (natural log); here one channel forgets at g = -25 a token
    over 40 tokens (a block range of 375: factors of e^187 would overflow), the others as in
    documents_case, so both kinds of blocks run in one call, against the float64 oracle at 1e-5."""
    from gdn_kernels.kda.common import FACTORED_RANGE

    inputs = strong_decay_inputs(1, DOCS[-1], 1, 2, 16, 48, seed=36, num_states=len(DOCS) - 1)
    inputs[3][0, 100:140, :, 1] = -25.0
    cu = torch.tensor(DOCS)
    block_ranges = torch.cat([(-inputs[3][0, s:e]).unfold(0, 16, 16).sum(-1).amax((1, 2))
                              for s, e in zip(DOCS[:-1], DOCS[1:]) if e - s >= 16])
    assert (block_ranges > FACTORED_RANGE.value).any() and (block_ranges <= FACTORED_RANGE.value).any()
    expected = run(inputs, "naive", torch.float64, cu)
    assert_close(run(inputs, "triton", torch.float32, cu), expected, 1e-5)


def test_bad_inputs_name_the_field():
    q, k, v, g, beta, _ = strong_decay_inputs(1, 8, 1, 2, 16, 16, seed=33, num_states=1)
    call = functools.partial(kda_triton.triton_kimi_delta_attention, scale=0.25)
    with pytest.raises(ValueError, match="g must be"):
        call(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="beta must be"):
        call(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="float64"):
        call(q.double(), k.double(), v.double(), g, beta)
    with pytest.raises(ValueError, match="share one dtype"):
        call(q.half(), k, v, g, beta)
    with pytest.raises(ValueError, match="initial_state"):
        call(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(q, k, v, g, beta, cu_seqlens=[0, 3, 9])
    with pytest.raises(ValueError, match="chunk_size"):   # on the kernels' device: it is checked first
        kimi_delta_attention(*(x.to(device) for x in (q, k, v, g, beta)), impl="triton", chunk_size=32)


def test_auto_runs_the_chunk_form_off_cuda():
    """impl="auto" takes the kernels for CUDA tensors only: here the PyTorch chunk form runs (float64 in,
    float64 out: the kernels would refuse it)."""
    inputs = strong_decay_inputs(1, 8, 1, 1, 16, 16, seed=34, num_states=1)
    o, _ = kimi_delta_attention(*(x.double() for x in inputs[:5]), impl="auto")
    assert o.dtype == torch.float64


def fla_errors(inputs, dtype, cu):
    """fla-core's chunk_kda on the same activated inputs: its results, or None without fla."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    leaves = [x.detach().to(device, dtype if i < 5 else torch.float32).requires_grad_()
              for i, x in enumerate(inputs)]
    q, k, v, g, beta, h0 = leaves
    o, final = chunk_kda(q, k, v, g.float(), beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                         output_final_state=True, cu_seqlens=cu.to(device).long())
    gen = generator(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    return [o, final, *torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), leaves)]


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("K", [64, 128, 256])
def test_head_sizes_and_dtypes_on_gpu(K, dtype):
    """Documents (one shorter than a chunk), grouped heads, initial states, strong decays, against the
    float64 oracle. fp32: 1e-4 (3xTF32 products in tests, tests/conftest.py). bf16: within 2x fla-core's
    own error on the same inputs where fla imports (each quantity at least 1e-2), else 2e-2."""
    cu = torch.tensor([0, 50, 300, 512])
    inputs = strong_decay_inputs(1, 512, 2, 4, K, K, seed=K, num_states=3)
    expected = run(inputs, "naive", torch.float64, cu)
    actual = run(inputs, "triton", dtype, cu.to(device))
    if dtype == torch.float32:
        assert_close(actual, expected, 1e-4)
        return
    reference = fla_errors(inputs, dtype, cu)
    for index, (name, a, e) in enumerate(zip(NAMES, actual, expected)):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = rel_err(a.detach().cpu(), e.cpu())
        fla_err = None if reference is None else rel_err(reference[index].detach().cpu(), e.cpu())
        bound = 2e-2 if fla_err is None else max(1e-2, 2 * fla_err)
        print(f"{name}: triton {err:.2e}, bound {bound:.2e}")
        assert err < bound, f"{name}: relative error {err:.2e} >= {bound:.2e}"


@gpu_only
@pytest.mark.gpu
def test_long_documents_bf16_deterministic_on_gpu():
    """8K tokens in three documents at gdn-1.3b's head size: the oracle (chunk form, float64) within
    2e-2, and two identical runs bit-equal (no races)."""
    T = 8192
    cu = torch.tensor([0, T // 3, T // 3 + 1000, T])
    inputs = strong_decay_inputs(1, T, 4, 4, 128, 128, seed=35, num_states=3)
    expected = run(inputs, "chunk", torch.float64, cu.to(device))
    actual = run(inputs, "triton", torch.bfloat16, cu.to(device))
    assert_close(actual, expected, 2e-2)
    again = run(inputs, "triton", torch.bfloat16, cu.to(device))
    for name, a, b in zip(NAMES, actual, again):
        assert torch.equal(a, b), f"{name} differs between two identical runs: a race?"
