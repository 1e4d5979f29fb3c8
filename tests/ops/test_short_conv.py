"""Causal short conv: vectorised vs the token-loop oracle (values and gradients), documents, halo."""
import pytest
import torch
import torch.nn.functional as F

from gdn_parallel.ops.short_conv import causal_conv1d, causal_conv1d_naive
from tests.seeds import generator


def _inputs(B, T, D, W, seed, with_bias=True, with_prefix=False):
    g = generator(seed)
    def mk(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
    return (mk(B, T, D), mk(D, W), mk(D) if with_bias else None, mk(B, W - 1, D) if with_prefix else None)


CASES = [  # (B, cu_seqlens); T = 11
    (2, None),
    (1, [0, 11]),
    (1, [0, 1, 4, 5, 11]),   # documents shorter than the kernel
    (1, [0, 6, 7, 11]),
]


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_vectorised_matches_naive_with_gradients(W, activation, with_prefix, case):
    B, cu = CASES[case]
    cu = None if cu is None else torch.tensor(cu)
    x, w, b, p = _inputs(B, 11, 5, W, seed=100 * W + case, with_prefix=with_prefix)
    leaves = [t for t in (x, w, b, p) if t is not None]
    y = causal_conv1d(x, w, b, activation, cu, p)
    y_ref = causal_conv1d_naive(x, w, b, activation, cu, p)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    dy = torch.randn(y.shape, generator=generator(7), dtype=torch.float64)
    grads = torch.autograd.grad(y, leaves, dy)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    for got, ref in zip(grads, grads_ref):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_naive_against_direct_formula():
    """The oracle itself, against F.conv1d on each document padded separately (prefix on the first)."""
    x, w, b, p = _inputs(1, 9, 3, 4, seed=3, with_prefix=True)
    cu = [0, 5, 6, 9]
    y = causal_conv1d_naive(x, w, b, "silu", torch.tensor(cu), p)
    pieces = []
    for d, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        left = p if d == 0 else torch.zeros(1, 3, 3, dtype=x.dtype)
        seg = torch.cat((left, x[:, s:e]), 1).transpose(1, 2)
        pieces.append(F.silu(F.conv1d(seg, w.unsqueeze(1), b, groups=3)).transpose(1, 2))
    torch.testing.assert_close(y, torch.cat(pieces, 1))


def test_documents_and_prefix_isolation():
    x, w, b, p = _inputs(1, 8, 4, 4, seed=5, with_prefix=True)
    cu = torch.tensor([0, 3, 8])
    y = causal_conv1d(x, w, b, "silu", cu, p)
    # the second document is the same as a fresh row without prefix
    torch.testing.assert_close(y[:, 3:], causal_conv1d(x[:, 3:], w, b, "silu"))
    # the first document equals the same tokens with the prefix prepended as real tokens
    full = causal_conv1d(torch.cat((p, x[:, :3]), 1), w, b, "silu")
    torch.testing.assert_close(y[:, :3], full[:, 3:])


def test_prefix_splits_a_row_like_context_parallelism():
    """Two halves with the halo as prefix give the same outputs as the whole packed row."""
    x, w, b, _ = _inputs(1, 12, 4, 4, seed=9)
    cu = torch.tensor([0, 2, 7, 12])
    whole = causal_conv1d(x, w, b, "silu", cu)
    first = causal_conv1d(x[:, :6], w, b, "silu", torch.tensor([0, 2, 6]))
    # the second half starts inside document [2, 7): its halo is tokens 3..5
    second = causal_conv1d(x[:, 6:], w, b, "silu", torch.tensor([0, 1, 6]), prefix=x[:, 3:6])
    torch.testing.assert_close(torch.cat((first, second), 1), whole)


def test_low_precision_dtype_kept():
    x, w, b, p = (t.detach().to(torch.bfloat16) for t in _inputs(1, 6, 4, 4, seed=1, with_prefix=True))
    for cu in (None, torch.tensor([0, 2, 6])):
        y = causal_conv1d(x, w, b, "silu", cu, p)
        assert y.dtype == torch.bfloat16
        ref = causal_conv1d_naive(x.double(), w.double(), b.double(), "silu", cu, p.double())
        torch.testing.assert_close(y.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_float32_master_weights_beside_half_precision_x(half):
    """An autocast run passes its fp32 conv weights as they are: the conv is computed in fp32 and y
    rounded once to x's dtype; the weight's and bias's gradients stay fp32, unrounded."""
    x, w, b, p = _inputs(1, 9, 4, 4, seed=11, with_prefix=True)
    xh, ph = (t.detach().to(half).requires_grad_() for t in (x, p))
    w32, b32 = (t.detach().float().requires_grad_() for t in (w, b))
    cu = torch.tensor([0, 4, 9])
    y = causal_conv1d(xh, w32, b32, "silu", cu, ph)
    ref_leaves = [t.detach().double().requires_grad_() for t in (xh, w32, b32, ph)]
    ref = causal_conv1d_naive(*ref_leaves[:3], "silu", cu, ref_leaves[3])
    assert y.dtype == half
    eps = torch.finfo(half).eps    # rounded once: within one unit in the last place of the exact value
    assert ((y.double() - ref).abs() <= eps * ref.abs() + 1e-30).all()
    dy = torch.randn(y.shape, generator=generator(12)).to(half)
    grads = torch.autograd.grad(y, (xh, w32, b32, ph), dy)
    grads_ref = torch.autograd.grad(ref, ref_leaves, dy.double())
    assert [g.dtype for g in grads] == [half, torch.float32, torch.float32, half]
    for got, want in zip(grads[1:3], grads_ref[1:3]):   # fp32 sums of fp32 products, no rounding to half
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_the_argument():
    x, w, b, p = (t.detach() for t in _inputs(1, 6, 4, 4, seed=0, with_prefix=True))
    with pytest.raises(ValueError, match="x"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w.unsqueeze(1))          # nn.Conv1d layout, not squeezed
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w[:3])
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w.float())
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(x, w, b[:2])
    with pytest.raises(ValueError, match="weight has dtype torch.float16 but x has torch.float32"):
        causal_conv1d(x.float(), w.half())       # only half-precision x takes fp32 weights
    with pytest.raises(ValueError, match="bias has dtype torch.float16 but weight has torch.float32"):
        causal_conv1d(x.half(), w.float(), b.half())
    with pytest.raises(ValueError, match="prefix"):
        causal_conv1d(x, w, b, prefix=p[:, 1:])
    with pytest.raises(ValueError, match="prefix"):
        causal_conv1d(x, w, b, prefix=p.float())
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, b, activation="gelu")
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(torch.cat((x, x)), w, b, cu_seqlens=torch.tensor([0, 6]))


def test_device_copies_of_boundaries_are_made_once_and_follow_edits():
    """Ops keep one device copy of host boundaries per tensor (a copy per layer would sync the GPU)."""
    from gdn_kernels.host_index import _derived, on_device

    cu = torch.tensor([0, 3, 8])
    first = on_device(cu, "meta")
    assert first.device.type == "meta" and on_device(cu, "meta") is first
    assert on_device(cu, "cpu") is cu
    cu.add_(0)                              # an in-place edit bumps the version: copy again
    assert on_device(cu, "meta") is not first
    key = id(cu)
    del cu
    assert key not in _derived              # dropped with the host tensor


def test_every_conv_of_a_row_shares_one_document_start_table(monkeypatch):
    """The per-token document starts are derived once per boundaries tensor, not once per conv call
    (three convs a GDN layer, each a handful of launches for the same table), and again after an
    in-place edit of the boundaries."""
    kernels = pytest.importorskip("gdn_kernels.short_conv")
    made = []
    original = kernels._document_starts
    monkeypatch.setattr(kernels, "_document_starts", lambda *a: made.append(a) or original(*a))
    monkeypatch.setattr(kernels._CausalConv1d, "apply", lambda x, w, b, p, start, silu: start)
    x, w = torch.randn(1, 8, 4), torch.randn(4, 3)
    cu = torch.tensor([0, 3, 8])
    starts = [kernels.triton_causal_conv1d(x, w, cu_seqlens=cu) for _ in range(3)]
    assert len(made) == 1 and all(s is starts[0] for s in starts)
    assert starts[0].tolist() == [0, 0, 0, 3, 3, 3, 3, 3]
    cu[1] = 5                               # an in-place edit: derived again, from the new values
    assert kernels.triton_causal_conv1d(x, w, cu_seqlens=cu).tolist() == [0] * 5 + [5] * 3
    assert len(made) == 2
