"""Triton gated delta rule against the PyTorch chunk oracle (float64): outputs, final states and every
gradient, on fresh random inputs. On CPU the kernels run in Triton's interpreter (fp32 / fp16, tiny
shapes); the bf16 checks at long sequences live in tools/check_kernels_gpu.py and the gpu tests."""
import zlib

import gdn_kernels.gated_delta_rule as gdn_triton  # noqa: E402  (after helpers: needs triton)
import pytest
import torch

from gdn_parallel.ops.gated_delta_rule import gated_delta_rule
from tests.kernels.helpers import device, gpu_only, rel_err
from tests.ops.gdn_inputs import gdn_inputs
from tests.seeds import generator


def run(inputs, impl, dtype, cu_seqlens=None, with_state=True):
    q, k, v, g, beta, h0 = [x.detach().to(device, dtype if i < 5 else torch.float32).requires_grad_()
                            for i, x in enumerate(inputs)]
    if impl == "chunk":
        q, k, v, g, beta, h0 = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = gated_delta_rule(q, k, v, g, beta, initial_state=h0 if with_state else None,
                                output_final_state=True, cu_seqlens=cu_seqlens, impl=impl)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    leaves = [q, k, v, g, beta] + ([h0] if with_state else [])
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), leaves)
    return [o, final, *grads]


NAMES = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def assert_close(actual, expected, tol):
    for name, a, e in zip(NAMES, actual, expected):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = rel_err(a.cpu(), e.cpu())
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("case", [
    dict(B=1, T=100, H=2, HV=2, K=32, V=32, cu=[0, 37, 100]),       # documents, padded chunks
    dict(B=2, T=64, H=1, HV=2, K=16, V=48, cu=None),                 # plain batch, grouped value heads
    dict(B=1, T=130, H=1, HV=1, K=48, V=80, cu=[0, 1, 66, 130]),    # 1-token doc, K/V not powers of 2
    dict(B=1, T=80, H=1, HV=1, K=256, V=256, cu=[0, 30, 80]),        # the largest head dims allowed
])
def test_matches_chunk_oracle_fp32(case):
    seed = zlib.crc32(repr(case).encode()) % 1000
    cu = None if case["cu"] is None else torch.tensor(case["cu"])
    n_states = case["B"] if cu is None else len(case["cu"]) - 1
    inputs = gdn_inputs(case["B"], case["T"], case["H"], case["HV"], case["K"], case["V"],
                        dtype=torch.float32, seed=seed, num_states=n_states, requires_grad=False)
    expected = run(inputs, "chunk", torch.float64, cu)
    actual = run(inputs, "triton", torch.float32, cu)
    assert_close(actual, expected, 1e-5)


def repeated_key_inputs(T, K, V, *, seed, beta=0.95, log_decay=-1e-3, noise=0.0):
    """The value pattern that broke the first GPU training steps: runs of one token (indentation,
    repeated bytes) give near-identical keys in a chunk; with beta near 1 and weak decay the
    strictly lower A = diag(beta)(K K^T o Gamma) has rows of ~1, where a power series for (I + A)^-1
    has terms ~1e17 that cancel. Real keys mix such runs with ordinary tokens: half the chunks here
    alternate runs of 24 alike keys with random ones."""
    gen = generator(seed)
    base = torch.randn(1, 1, 1, K, generator=gen)
    k = base + noise * torch.randn(1, T, 1, K, generator=gen)
    ordinary = torch.randn(1, T, 1, K, generator=gen)
    mixed = (torch.arange(T) // 24 % 2 == 1) & (torch.arange(T) >= T // 2)
    k = torch.where(mixed[None, :, None, None], ordinary, k)
    k = torch.nn.functional.normalize(k, dim=-1)
    q = torch.randn(1, T, 1, K, generator=gen)
    v = torch.randn(1, T, 1, V, generator=gen)
    g = torch.full((1, T, 1), log_decay)
    b = torch.full((1, T, 1), beta)
    h0 = torch.randn(1, 1, K, V, generator=gen)
    return [q, k, v, g, b, h0]


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_repeated_keys_with_weak_decay_stay_exact(noise):
    """Regression: identical (or nearly) keys through whole chunks; T = (I + A)^-1 itself is tame
    (entries -beta (1 - beta)^(i-j-1)), so the kernels must match the oracle as on random inputs."""
    inputs = repeated_key_inputs(192, 16, 16, seed=5, noise=noise)
    expected = run(inputs, "chunk", torch.float64)
    actual = run(inputs, "triton", torch.float32)
    assert_close(actual, expected, 1e-5)


def test_span_parallel_walk_matches(monkeypatch):
    """Spans of 2 chunks: documents of 1, 2 and 9 chunks (one too short to split, one split 5 ways)."""
    monkeypatch.setitem(gdn_triton.TUNING, "span_chunks", 2)
    cu = torch.tensor([0, 37, 150, 700])
    inputs = gdn_inputs(1, 700, 1, 2, 16, 32, dtype=torch.float32, seed=7, num_states=3, requires_grad=False)
    expected = run(inputs, "chunk", torch.float64, cu)
    actual = run(inputs, "triton", torch.float32, cu)
    assert_close(actual, expected, 1e-5)


def test_backward_recomputing_chunk_states_matches(monkeypatch):
    """save_chunk_states=False: the backward recomputes W, the chunk states and Delta."""
    monkeypatch.setitem(gdn_triton.TUNING, "save_chunk_states", False)
    cu = torch.tensor([0, 37, 100])
    inputs = gdn_inputs(1, 100, 2, 4, 16, 32, dtype=torch.float32, seed=9, num_states=2, requires_grad=False)
    assert_close(run(inputs, "triton", torch.float32, cu), run(inputs, "chunk", torch.float64, cu), 1e-5)


@pytest.mark.parametrize("K, key_block", [(64, 32), (96, 32)])
def test_backward_in_key_tiles_matches(monkeypatch, K, key_block):
    """qkw_backward and ut_backward with the key columns in tiles (as on a device that cannot hold all
    of K: fp32 at K = 256): two tiles, and four of which the last is all padding columns (K = 96),
    with documents and grouped value heads."""
    monkeypatch.setitem(gdn_triton.TUNING, "backward_key_block", key_block)
    cu = torch.tensor([0, 37, 130])
    inputs = gdn_inputs(1, 130, 1, 2, K, 32, dtype=torch.float32, seed=K, num_states=2, requires_grad=False)
    assert_close(run(inputs, "triton", torch.float32, cu), run(inputs, "chunk", torch.float64, cu), 1e-5)


def test_without_initial_state_fp16():
    inputs = gdn_inputs(1, 96, 2, 4, 32, 32, dtype=torch.float32, seed=3, requires_grad=False)
    expected = run(inputs, "chunk", torch.float64, with_state=False)
    actual = run(inputs, "triton", torch.float16, with_state=False)
    assert_close(actual, expected, 2e-2)


def test_every_output_element_is_written(monkeypatch):
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(gdn_triton, "_buffer", poisoned)
    inputs = gdn_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32, seed=4, num_states=2, requires_grad=False)
    actual = run(inputs, "triton", torch.float32, torch.tensor([0, 5, 70]))
    expected = run(inputs, "chunk", torch.float64, torch.tensor([0, 5, 70]))
    assert_close(actual, expected, 1e-5)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("T", [4096, 65536])
def test_bf16_against_fp32_reference_on_gpu(T):
    inputs = gdn_inputs(1, T, 4, 4, 128, 128, dtype=torch.float32, seed=T, num_states=3, requires_grad=False)
    cu = torch.tensor([0, T // 3, T // 3 + 1000, T], device=device)
    expected = run(inputs, "chunk", torch.float64, cu)
    actual = run(inputs, "triton", torch.bfloat16, cu)
    assert_close(actual, expected, 1e-2)
    again = run(inputs, "triton", torch.bfloat16, cu)
    for name, a, b in zip(NAMES, actual, again):
        assert torch.equal(a, b), f"{name} differs between two identical runs: a race?"


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_repeated_keys_bf16_on_gpu(noise):
    """The value pattern of the first-step NaN at the 1.3B shapes (K = 128, V = 256, bf16, TF32 on
    Hopper), against the float64 oracle.

    Alike keys with beta near 1 make some gradients (dbeta, dg) small differences of large terms, so
    bf16 rounding costs more here than on random inputs: the oracle itself, fed the bf16-rounded
    inputs, is off by up to ~4e-3 (H200). The kernels round again inside (the bf16 operands of every
    product), so each quantity may be off by 1e-2 or four times the input rounding's own error,
    whichever is larger; a NaN or the old power-series collapse (errors of order 1) still fails."""
    inputs = repeated_key_inputs(4096, 128, 256, seed=21, noise=noise)
    expected = run(inputs, "chunk", torch.float64)
    bf16_inputs = [x.to(torch.bfloat16).to(x.dtype) if i < 5 else x for i, x in enumerate(inputs)]
    input_rounding = run(bf16_inputs, "chunk", torch.float64)
    actual = run(inputs, "triton", torch.bfloat16)
    for name, a, r, e in zip(NAMES, actual, input_rounding, expected):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err, rounding_err = rel_err(a.cpu(), e.cpu()), rel_err(r.cpu(), e.cpu())
        print(f"{name}: triton bf16 {err:.2e}, oracle on bf16-rounded inputs {rounding_err:.2e}")
        assert err < max(1e-2, 4 * rounding_err), \
            f"{name}: {err:.2e} (input rounding alone {rounding_err:.2e})"


# Every head size the op accepts, in every input dtype: the launch settings step down where a device
# lacks the shared memory for the first choice (fp32 inputs at K = 256: the backward in two key tiles),
# with the same accuracy.
HEAD_GRID = [(16, 32), (32, 32), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256)]


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("K, V", HEAD_GRID)
def test_every_head_size_and_dtype_on_gpu(K, V, dtype):
    cu = torch.tensor([0, 100, 300, 512], device=device)
    inputs = gdn_inputs(1, 512, 2, 2, K, V, dtype=torch.float32, seed=K + V, num_states=3,
                        requires_grad=False)
    # fp32: 3xTF32 products in tests (tests/conftest.py); half-precision bounds as in the tests above
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-2}[dtype]
    assert_close(run(inputs, "triton", dtype, cu), run(inputs, "chunk", torch.float64, cu), tol)


@pytest.mark.parametrize("beta_activation, use_qk_l2norm", [("sigmoid", True), ("2sigmoid", False)])
def test_fused_gate_activations_match_oracle(beta_activation, use_qk_l2norm):
    """g and beta given as logits with (A_log, dt_bias), q and k raw: the kernels' first launch
    activates and normalises them. Documents end mid-chunk, so the padding (logits -inf, zero q/k)
    must leave the final states alone."""
    cu = torch.tensor([0, 37, 100])
    gen = torch.Generator().manual_seed(11)
    q, k, v, _, _, h0 = gdn_inputs(1, 100, 2, 4, 16, 32, dtype=torch.float32, seed=11, num_states=2,
                                   requires_grad=False)
    a, b = torch.randn(1, 100, 4, generator=gen), torch.randn(1, 100, 4, generator=gen)
    if use_qk_l2norm:  # raw rows of varied norms
        q, k = q * 3.0, k * torch.rand(1, 100, 2, 1, generator=gen).add(0.5)
    A_log, dt_bias = torch.rand(4, generator=gen) * 2.0, torch.randn(4, generator=gen) - 3.0

    def results(impl, dtype):
        leaves = [x.detach().to(device, dtype).requires_grad_() for x in (q, k, v, a, b, h0, A_log, dt_bias)]
        o, final = gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                    cu_seqlens=cu, impl=impl, decay_params=tuple(leaves[6:]),
                                    beta_activation=beta_activation, use_qk_l2norm=use_qk_l2norm)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(o)
        return [o, final, *torch.autograd.grad((o * do).sum() + final.square().sum(), leaves)]

    expected, actual = results("chunk", torch.float64), results("triton", torch.float32)
    names = ["o", "final", "dq", "dk", "dv", "da", "db", "dh0", "dA_log", "ddt_bias"]
    for name, x, e in zip(names, actual, expected):
        err = rel_err(x.cpu(), e.cpu())
        assert torch.isfinite(x).all() and err < 1e-5, f"{name}: relative error {err:.2e}"
