"""Fused Triton short conv against the PyTorch path: outputs and every gradient.

On CPU the kernels run in Triton's interpreter (tiny shapes, fp32/fp16: the interpreter's bf16 is
unreliable); the bf16 test at training size needs a GPU.
"""
import importlib

import pytest
import torch

from gdn_parallel.ops.short_conv import causal_conv1d
from tests.seeds import generator

from .helpers import device, gpu_only, rel_err  # skips the module without triton

sc = importlib.import_module("gdn_kernels.short_conv")  # after helpers: it imports triton

CASES = [  # (B, T, D, W, cu_seqlens, bias, prefix, activation)
    (2, 40, 24, 4, None, True, False, "silu"),
    (2, 33, 7, 4, None, False, True, None),
    (1, 40, 24, 4, [0, 3, 4, 21, 40], True, True, "silu"),   # documents shorter than the kernel
    (1, 37, 5, 4, [0, 1, 2, 37], False, False, "silu"),
    (1, 19, 9, 3, [0, 10, 19], True, True, None),
    (1, 9, 3, 2, [0, 5, 9], True, True, "swish"),
    (1, 2, 4, 4, None, True, True, "silu"),                  # fewer tokens than the prefix
]


def _inputs(B, T, D, W, with_bias, with_prefix, dtype, seed=0):
    g = generator(seed)
    def mk(*s):
        return torch.randn(*s, generator=g).to(device, dtype).requires_grad_()
    x, w = mk(B, T, D), mk(D, W)
    return x, w, mk(D) if with_bias else None, mk(B, W - 1, D) if with_prefix else None


def _run(impl, x, w, b, p, activation, cu, dy):
    leaves = [t for t in (x, w, b, p) if t is not None]
    y = causal_conv1d(x, w, b, activation, cu, p, impl=impl)
    return [y, *torch.autograd.grad(y, leaves, dy)]


def _compare(case, dtype, tol, seed=0):
    B, T, D, W, cu, with_bias, with_prefix, activation = case
    cu = None if cu is None else torch.tensor(cu, device=device)
    x, w, b, p = _inputs(B, T, D, W, with_bias, with_prefix, dtype, seed)
    dy = torch.randn(B, T, D, generator=generator(seed + 1)).to(device, dtype)
    got = _run("triton", x, w, b, p, activation, cu, dy)
    # reference: the torch path in fp32 on the same (rounded) inputs
    ref_in = [None if t is None else t.detach().float().requires_grad_() for t in (x, w, b, p)]
    ref = _run("torch", *ref_in, activation, cu, dy.float())
    names = ["y", "dx", "dweight"] + ["dbias"] * with_bias + ["dprefix"] * with_prefix
    for name, a, r in zip(names, got, ref):
        assert a.dtype == dtype and a.shape == r.shape, name
        assert rel_err(a, r) < tol, f"{name}: rel err {rel_err(a, r):.2e}"
    return got


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_torch_fp32(case):
    _compare(CASES[case], torch.float32, 1e-5)


@pytest.mark.parametrize("case", [0, 2, 4])
def test_matches_torch_fp16(case):
    _compare(CASES[case], torch.float16, 5e-3)


def test_float32_master_weights_beside_fp16_x():
    """An autocast run's fp32 conv weight and bias, passed as they are: the kernels read them unrounded
    and return their gradients in fp32, as the PyTorch path computes them in fp32."""
    B, T, D, W, cu = 1, 40, 24, 4, torch.tensor([0, 3, 4, 21, 40], device=device)
    x, w, b, p = _inputs(B, T, D, W, True, True, torch.float32, seed=3)
    xh, ph = (t.detach().half().requires_grad_() for t in (x, p))
    dy = torch.randn(B, T, D, generator=generator(4)).to(device, torch.float16)
    got = _run("triton", xh, w, b, ph, "silu", cu, dy)
    ref = _run("torch", xh, w, b, ph, "silu", cu, dy)
    half, full = torch.float16, torch.float32
    assert [t.dtype for t in got] == [half, half, full, full, half]
    for name, a, r, tol in zip(["y", "dx", "dweight", "dbias", "dprefix"], got, ref,
                               [5e-3, 5e-3, 1e-5, 1e-5, 5e-3]):   # fp32 sums on both sides for dw, db
        assert rel_err(a, r) < tol, f"{name}: rel err {rel_err(a, r):.2e}"


def test_small_tiles_many_programs(monkeypatch):
    """Several token chunks, channel blocks and tiles per chunk, at interpreter-sized shapes."""
    monkeypatch.setattr(sc, "BLOCK_T", 8)
    monkeypatch.setattr(sc, "DZ_BLOCK_T", 8)
    monkeypatch.setattr(sc, "BLOCK_D", 16)
    monkeypatch.setattr(sc, "CHUNK_T", 16)
    _compare((1, 40, 24, 4, [0, 3, 4, 21, 40], True, True, "silu"), torch.float32, 1e-5)
    _compare((2, 37, 20, 3, None, True, True, None), torch.float32, 1e-5)


@pytest.mark.parametrize("W", [4, 5])
def test_several_tiles_a_program(monkeypatch, W):
    """The forward and dx passes over three tiles a program (W = 4: the weights loaded once for
    them; W = 5: the generic path), with a last program whose tiles run past the end."""
    monkeypatch.setattr(sc, "BLOCK_T", 8)
    monkeypatch.setattr(sc, "BLOCK_D", 16)
    monkeypatch.setattr(sc, "TILES_PER_PROGRAM", 3)
    _compare((1, 40, 24, W, [0, 3, 4, 21, 40], True, True, "silu"), torch.float32, 1e-5)
    _compare((2, 37, 20, W, None, False, False, None), torch.float32, 1e-5)


# Half of the 16 combinations of the four options: those with an even number switched on. Every
# combination of any three options is among them (a 2^(4-1) design), at half the interpreter's time.
OPTIONS = [(prefix, cu, bias, act) for prefix in (False, True) for cu in (False, True)
           for bias in (False, True) for act in (None, "silu")
           if (prefix + cu + bias + (act is not None)) % 2 == 0]


# Width 1 with a prefix and documents is left out: the torch reference never reads an empty prefix
# there, and autograd refuses the gradient of an input it did not read.
WIDTH_OPTIONS = [(W, *options) for options in OPTIONS for W in (1, 2, 3, 4, 5)
                 if not (W == 1 and options[0] and options[1])]


@pytest.mark.parametrize("W, with_prefix, with_cu, with_bias, activation", WIDTH_OPTIONS)
def test_every_width_with_and_without_each_option(monkeypatch, W, with_prefix, with_cu, with_bias,
                                                  activation):
    """The backward's first pass has one accumulator per tap for W <= 4 and a generic path beyond:
    each width, with and without prefix, documents, bias and activation (every three of them in each
    combination), over several chunks, tiles and channel blocks (the last of each partial)."""
    monkeypatch.setattr(sc, "BLOCK_T", 8)
    monkeypatch.setattr(sc, "DZ_BLOCK_T", 8)
    monkeypatch.setattr(sc, "BLOCK_D", 16)
    monkeypatch.setattr(sc, "CHUNK_T", 16)
    cu = [0, 2, 9, 37] if with_cu else None  # a document shorter than the kernel
    _compare((1 if with_cu else 2, 37, 20, W, cu, with_bias, with_prefix, activation), torch.float32, 1e-5,
             seed=W)


def test_every_output_element_is_written(monkeypatch):
    """Output and partial-sum buffers start as NaN: a skipped element would show up."""
    nan = float("nan")
    monkeypatch.setattr(torch, "empty", lambda *s, **kw: torch.full(s if len(s) > 1 else s[0], nan, **kw))
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, nan, **kw))
    monkeypatch.setattr(sc, "BLOCK_T", 8)
    monkeypatch.setattr(sc, "CHUNK_T", 16)
    got = _compare((1, 35, 20, 4, [0, 6, 35], True, True, "silu"), torch.float32, 1e-5)
    got += _compare((1, 3, 5, 4, None, True, True, None), torch.float32, 1e-5)
    assert all(bool(t.isfinite().all()) for t in got)


def test_prefix_splits_a_row_like_context_parallelism():
    x, w, b, _ = (t.detach() if t is not None else None
                  for t in _inputs(1, 24, 6, 4, True, False, torch.float32, seed=3))
    whole = causal_conv1d(x, w, b, "silu", torch.tensor([0, 5, 14, 24]), impl="triton")
    first = causal_conv1d(x[:, :12], w, b, "silu", torch.tensor([0, 5, 12]), impl="triton")
    # the second half starts inside document [5, 14): its halo is tokens 9..11
    second = causal_conv1d(x[:, 12:], w, b, "silu", torch.tensor([0, 2, 12]), prefix=x[:, 9:12],
                           impl="triton")
    assert rel_err(torch.cat((first, second), 1), whole) < 1e-6


def test_impl_argument():
    x, w, b, _ = (t.detach() if t is not None else None
                  for t in _inputs(1, 8, 4, 4, True, False, torch.float64))
    with pytest.raises(ValueError, match="impl"):
        causal_conv1d(x, w, b, impl="cuda")
    with pytest.raises(ValueError, match="impl='triton'"):  # fp64 stays on the torch path
        causal_conv1d(x, w, b, impl="triton")
    if device == "cpu":  # auto never picks the interpreter
        assert torch.equal(causal_conv1d(x, w, b), causal_conv1d(x, w, b, impl="torch"))


@gpu_only
@pytest.mark.gpu
def test_bf16_training_size_and_determinism():
    T, D, W = 65536, 2048, 4
    case = (1, T, D, W, [0, 1000, 1003, 40000, T], True, True, "silu")
    got = _compare(case, torch.bfloat16, 1e-2)
    again = _compare(case, torch.bfloat16, 1e-2)
    for a, b in zip(got, again):
        assert torch.equal(a, b), "same inputs gave different bits"
