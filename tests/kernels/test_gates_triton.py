"""Gate kernels (gdn_kernels.gated_delta_rule.gates) against a float64 PyTorch reference.

The reference is the formula itself: g_act = -exp(A_log) * softplus(a + dt_bias) (or g as given),
gamma = chunk-local cumsum in head-major [HV, Tp], beta through its activation; the backward is
torch.autograd on it. bf16 inputs are compared against the reference on the same bf16 values: the
kernels do fp32 math, so gamma and the gradients stay tight and only beta_out (stored in bf16) is
loose. Tiny shapes: on CPU the kernels run in Triton's interpreter.
"""
import importlib
import math

import pytest
import torch

from tests.seeds import generator

from .helpers import device, rel_err  # skips the module without triton

gates = importlib.import_module("gdn_kernels.gated_delta_rule.gates")  # after helpers: imports triton
build_layout = importlib.import_module("gdn_kernels.chunk_layout").build_layout
C = 64
HV = 3


def _softplus(x):
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def reference(g, beta, decay_params, beta_activation):
    """(gamma [HV, Tp], beta_out [Tp, HV]) in float64 from float64 inputs (autograd-able)."""
    Tp, hv = g.shape
    g_act = g
    if decay_params is not None:
        A_log, dt_bias = decay_params
        g_act = -A_log.exp() * _softplus(g + dt_bias)
    gamma = g_act.reshape(Tp // C, C, hv).cumsum(1).reshape(Tp, hv).t()
    if beta_activation is None:
        beta_out = beta
    else:
        beta_out = torch.sigmoid(beta) * (2.0 if beta_activation == "2sigmoid" else 1.0)
    return gamma, beta_out


def _inputs(Tp, dtype, with_params, seed=0):
    gen = generator(seed)
    if with_params:  # raw logits a; dt_bias = softplus^-1(dt), dt in [1e-3, 0.1] as in the model
        g = torch.randn(Tp, HV, generator=gen) * 2
        dt = torch.exp(torch.rand(HV, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        params = (torch.rand(HV, generator=gen) * 2.7 + 0.1, dt + torch.log(-torch.expm1(-dt)))
        params = tuple(p.to(device) for p in params)
    else:  # g is the log decay itself (<= 0)
        g = -torch.rand(Tp, HV, generator=gen) * 0.5
        params = None
    beta = torch.randn(Tp, HV, generator=gen) * 2
    dgamma = torch.randn(HV, Tp, generator=gen)
    dbeta = torch.randn(Tp, HV, generator=gen)
    return (g.to(device, dtype), beta.to(device, dtype), params, dgamma.to(device), dbeta.to(device))


def _reference_grads(g, beta, params, act, dgamma, dbeta):
    """Forward outputs and (dg, dbeta_in, dA_log, ddt_bias) of the float64 reference."""
    leaves = [t.detach().double().requires_grad_() for t in (g, beta)]
    p64 = None if params is None else tuple(p.detach().double().requires_grad_() for p in params)
    gamma, beta_out = reference(leaves[0], leaves[1], p64, act)
    loss = (gamma * dgamma.double()).sum() + (beta_out * dbeta.double()).sum()
    wrt = leaves + ([] if p64 is None else list(p64))
    grads = torch.autograd.grad(loss, wrt)
    grads = list(grads) + [None, None] * (p64 is None)
    return gamma.detach(), beta_out.detach(), grads


CASES = [  # (beta_activation, with decay params)
    (None, False),
    ("sigmoid", True),
    ("2sigmoid", True),
    ("sigmoid", False),
    (None, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,with_params", CASES)
def test_matches_reference(poisoned, act, with_params, dtype):
    Tp = 192
    g, beta, params, dgamma, dbeta = _inputs(Tp, dtype, with_params)
    gamma_ref, beta_ref, (dg_ref, db_ref, dA_ref, ddt_ref) = _reference_grads(g, beta, params, act, dgamma,
                                                                              dbeta)

    gamma, beta_out = gates.gate_forward(g, beta, params, act)
    assert gamma.shape == (HV, Tp) and gamma.dtype == torch.float32 and gamma.is_contiguous()
    assert beta_out.shape == (Tp, HV) and beta_out.dtype == dtype
    assert rel_err(gamma, gamma_ref) < 1e-5
    assert rel_err(beta_out, beta_ref) < (1e-5 if dtype == torch.float32 or act is None else 1e-2)

    dg, db, dA, ddt = gates.gate_backward(dgamma, dbeta, g, beta, params, act)
    assert dg.shape == (Tp, HV) and dg.dtype == torch.float32
    assert db.shape == (Tp, HV) and db.dtype == torch.float32
    assert rel_err(dg, dg_ref) < 1e-5
    assert rel_err(db, db_ref) < 1e-5
    if with_params:
        assert dA.shape == (HV,) and dA.dtype == torch.float32
        assert ddt.shape == (HV,) and ddt.dtype == torch.float32
        assert rel_err(dA, dA_ref) < 1e-5
        assert rel_err(ddt, ddt_ref) < 1e-5
    else:
        assert dA is None and ddt is None


def test_softplus_precision(poisoned):
    """Every gamma elementwise, at x = a + dt_bias in the small-exp regime (where log(1 + exp(x))
    would lose digits), around the x > 20 switch, and far into both tails."""
    xs = torch.tensor([-30.0, -8.0, -3.0, 0.5, 19.5, 25.0], dtype=torch.float64)
    g = xs.repeat(C // len(xs) + 1)[:C].reshape(C, 1).repeat(1, HV).float()
    g[:, 1] = g[:, 1].flip(0)
    params = (torch.tensor([0.0, -1.0, 1.0], device=device), torch.zeros(HV, device=device))
    g = g.to(device)
    gamma, _ = gates.gate_forward(g, g, params)
    gamma_ref, _ = reference(g.double(), g.double(), tuple(p.double() for p in params), None)
    assert ((gamma.double() - gamma_ref).abs() / gamma_ref.abs()).max().item() < 1e-5


@pytest.mark.parametrize("act", ["sigmoid", "2sigmoid"])
def test_padded_rows(poisoned, act):
    """Rows with raw logits -inf (document padding): decay 0, so gamma carries through them unchanged;
    beta 0; and zero, finite gradients there whatever dgamma / dbeta hold."""
    Tp = 128
    g, beta, params, dgamma, dbeta = _inputs(Tp, torch.float32, True, seed=1)
    pad = torch.zeros(Tp, dtype=torch.bool, device=device)
    pad[50:64] = True   # the end of chunk 0
    pad[100:128] = True  # the end of chunk 1
    g = g.masked_fill(pad[:, None], -math.inf)
    beta = beta.masked_fill(pad[:, None], -math.inf)

    gamma, beta_out = gates.gate_forward(g, beta, params, act)
    assert torch.isfinite(gamma).all()
    # Carried unchanged up to the scan's rounding (a GPU scan adds in a tree: not bit-equal there).
    torch.testing.assert_close(gamma[:, 50:64], gamma[:, 49:50].expand(-1, 14), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gamma[:, 100:128], gamma[:, 99:100].expand(-1, 28), rtol=1e-6, atol=1e-6)
    assert (beta_out[pad] == 0).all()
    # Exactly zero decay in padding, whatever the scan's order: all-padding rows give gamma 0.
    all_pad = torch.full_like(g, -math.inf)
    gamma_pad, beta_pad = gates.gate_forward(all_pad, all_pad, params, act)
    assert (gamma_pad == 0).all() and (beta_pad == 0).all()
    gamma_ref, beta_ref, (dg_ref, db_ref, dA_ref, ddt_ref) = _reference_grads(g, beta, params, act, dgamma,
                                                                              dbeta)
    assert rel_err(gamma, gamma_ref) < 1e-5
    assert rel_err(beta_out, beta_ref) < 1e-5

    dg, db, dA, ddt = gates.gate_backward(dgamma, dbeta, g, beta, params, act)
    for t in (dg, db, dA, ddt):
        assert torch.isfinite(t).all()
    assert (dg[pad] == 0).all() and (db[pad] == 0).all()
    assert rel_err(dg, dg_ref) < 1e-5 and rel_err(db, db_ref) < 1e-5
    assert rel_err(dA, dA_ref) < 1e-5 and rel_err(ddt, ddt_ref) < 1e-5


def test_parameter_grads_deterministic():
    g, beta, params, dgamma, dbeta = _inputs(192, torch.float32, True, seed=2)
    first = gates.gate_backward(dgamma, dbeta, g, beta, params, "sigmoid")
    second = gates.gate_backward(dgamma, dbeta, g, beta, params, "sigmoid")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bad_arguments():
    g = torch.zeros(128, HV, device=device)
    params = (torch.zeros(HV, device=device), torch.zeros(HV, device=device))
    bad = [
        ({"g": torch.zeros(100, HV, device=device), "beta": torch.zeros(100, HV, device=device)}, "multiple"),
        ({"g": torch.zeros(128, HV, 1, device=device), "beta": torch.zeros(128, HV, 1, device=device)}, "g"),
        ({"beta": torch.zeros(128, HV + 1, device=device)}, "beta"),
        ({"beta_activation": "tanh"}, "beta_activation"),
        ({"decay_params": (torch.zeros(HV + 1, device=device), params[1])}, "A_log"),
        ({"decay_params": (params[0], torch.zeros(1, HV, device=device))}, "dt_bias"),
        ({"decay_params": params[:1]}, "decay_params"),
    ]
    for override, field in bad:
        kwargs = {"g": g, "beta": g, "decay_params": None, "beta_activation": None} | override
        with pytest.raises(ValueError, match=field):
            gates.gate_forward(**kwargs)
        Tp, hv = kwargs["g"].shape[:2]
        with pytest.raises(ValueError, match=field):
            gates.gate_backward(torch.zeros(hv, Tp, device=device), torch.zeros(Tp, hv, device=device),
                                **kwargs)
    dgamma, dbeta = torch.zeros(HV, 128, device=device), torch.zeros(128, HV, device=device)
    with pytest.raises(ValueError, match="dgamma"):
        gates.gate_backward(dgamma.t(), dbeta, g, g)
    with pytest.raises(ValueError, match="dbeta"):
        gates.gate_backward(dgamma, dbeta[:64], g, g)


@pytest.mark.parametrize("act,with_params,norm_qk", [("sigmoid", True, True), (None, False, False),
                                                      ("2sigmoid", True, False)])
def test_layout_reads_the_callers_rows_and_writes_them_padded(poisoned, act, with_params, norm_qk):
    """With a chunk layout the launch reads unpadded documents (ends mid-chunk, a 1-token document)
    and writes them padded: the same values as the launch over rows the caller padded itself (logits
    -inf, zero q and k), and gradients that are those rows' gradients, back in the caller's rows."""
    layout = build_layout([37, 64, 1, 90], C, device)
    tokens, Tp = layout.num_tokens, layout.padded_len
    g, beta, params, dgamma, dbeta = _inputs(Tp, torch.float32, with_params, seed=5)
    g, beta = g[:tokens], beta[:tokens]
    gen = generator(6)
    qk = tuple(torch.randn(tokens, 1, 24, generator=gen).to(device) * 3 for _ in range(2)) if norm_qk \
        else None
    d_qk = tuple(torch.randn(Tp, 1, 24, generator=gen).to(device) for _ in range(2))
    g_fill = -math.inf if with_params else 0.0
    b_fill = 0.0 if act is None else -math.inf
    padded = (layout.pad(g, g_fill).flatten(0, 1), layout.pad(beta, b_fill).flatten(0, 1))
    qk_padded = None if qk is None else tuple(layout.pad(x).flatten(0, 1) for x in qk)

    ours = gates.gate_forward(g, beta, params, act, qk, layout=layout)
    theirs = gates.gate_forward(*padded, params, act, qk_padded)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    norm = None if qk is None else (*ours[2:], *d_qk)
    norm_padded = None if qk is None else (*theirs[2:], *d_qk)
    ours = gates.gate_backward(dgamma, dbeta, g, beta, params, act, norm, layout=layout)
    theirs = gates.gate_backward(dgamma, dbeta, *padded, params, act, norm_padded)
    real = layout.token_dest
    for name, a, b in zip(["dg", "dbeta", "dA_log", "ddt_bias", "dq", "dk"], ours, theirs):
        if a is None:
            assert b is None, name
            continue
        expected = b if name in ("dA_log", "ddt_bias") else b[real]
        assert a.shape == expected.shape, name
        torch.testing.assert_close(a, expected, rtol=1e-6, atol=1e-6, msg=name)


def test_layout_must_match_the_rows():
    layout = build_layout([37, 90], C, device)
    g = torch.zeros(128, HV, device=device)
    with pytest.raises(ValueError, match="layout lays out 127"):
        gates.gate_forward(g, g, layout=layout)
