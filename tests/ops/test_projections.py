"""project (several projections of one input, dx summed in the products) against its oracle, the
projections called one by one through autograd: outputs and every gradient, float64 and under
autocast; unused outputs, frozen weights and the modules it leaves to themselves."""
import contextlib

import pytest
import torch
from torch import nn

from gdn_parallel.ops import projections
from gdn_parallel.ops.projections import project, project_reference
from tests.compare import assert_close_set
from tests.op_counts import OpCounter
from tests.seeds import generator, seed_torch


def _linears(widths, hidden, dtype, bias=False):
    seed_torch(11)
    return [nn.Linear(hidden, w, bias=bias, dtype=dtype) for w in widths]


def _run(fn, x, linears, douts, use=None):
    x = x.detach().clone().requires_grad_()
    for m in linears:
        m.zero_grad(set_to_none=True)
    outs = fn(x, *linears)
    use = range(len(outs)) if use is None else use
    torch.autograd.backward([outs[i] for i in use], [douts[i] for i in use])
    got = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    got["dx"] = x.grad
    got.update({f"dw{i}": m.weight.grad for i, m in enumerate(linears) if m.weight.grad is not None})
    return got


def _inputs(shape, widths, dtype, seed):
    gen = generator(seed)
    x = torch.randn(*shape, generator=gen, dtype=dtype)
    douts = [torch.randn(*shape[:-1], w, generator=gen, dtype=dtype) for w in widths]
    return x, douts


@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16)])
def test_matches_autograd_reference_float64(shape):
    widths = (12, 12, 24, 3, 3, 24)  # a GDN layer's q, k, v, a, b, g
    linears = _linears(widths, shape[-1], torch.float64)
    x, douts = _inputs(shape, widths, torch.float64, 1)
    got = _run(project, x, linears, douts)
    assert set(got) == {"dx", *(f"out{i}" for i in range(6)), *(f"dw{i}" for i in range(6))}
    assert_close_set(got, _run(project_reference, x, linears, douts), 1e-12, f"shape {shape}")


def test_under_autocast_fp32_weights_get_fp32_gradients():
    widths = (8, 8, 16)
    linears = _linears(widths, 32, torch.float32)
    x, douts = _inputs((3, 6, 32), widths, torch.float32, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(project, x, linears, [d.bfloat16() for d in douts])
    # the oracle: the same weights in fp64
    want_linears = [nn.Linear(32, w, bias=False, dtype=torch.float64) for w in widths]
    for ref, m in zip(want_linears, linears):
        ref.weight.data.copy_(m.weight.data)
    want = _run(project_reference, x.double(), want_linears, [d.double() for d in douts])
    assert got["out0"].dtype == torch.bfloat16 and got["dx"].dtype == torch.float32
    assert all(got[f"dw{i}"].dtype == torch.float32 for i in range(3))
    assert_close_set({k: v.double() for k, v in got.items()}, want, 3e-2, "bf16 autocast")


def test_an_unused_output_costs_nothing_and_gets_no_gradient():
    widths = (4, 6, 5)
    linears = _linears(widths, 8, torch.float64)
    x, douts = _inputs((9, 8), widths, torch.float64, 3)
    got = _run(project, x, linears, douts, use=[0, 2])
    want = _run(project_reference, x, linears, douts, use=[0, 2])
    assert "dw1" not in got and "dw1" not in want
    assert_close_set(got, want, 1e-12, "output 1 unused")


def test_frozen_weights_and_a_frozen_input():
    widths = (4, 6)
    linears = _linears(widths, 8, torch.float64)
    linears[1].weight.requires_grad_(False)
    x, douts = _inputs((9, 8), widths, torch.float64, 4)
    got = _run(project, x, linears, douts)
    assert "dw1" not in got
    assert_close_set(got, _run(project_reference, x, linears, douts), 1e-12, "w1 frozen")
    outs = project(x, *linears)  # x without grad: only the weight that trains gets one
    outs[0].sum().backward()
    assert linears[0].weight.grad is not None


def test_the_input_gradient_is_summed_inside_the_products(monkeypatch):
    """One product per projection for dx, the later ones accumulating (addmm_), no separate adds."""
    calls = []
    real = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    linears = _linears((4, 4, 4), 8, torch.float64)
    x, douts = _inputs((5, 8), (4, 4, 4), torch.float64, 5)
    _run(project, x, linears, douts)
    assert len(calls) == 2


def test_one_projection_takes_the_same_path():
    """`linear` (one projection: the mixers' output projections) against module(x): outputs and
    gradients in fp64, and the fp32 weight's gradient in fp32 under autocast."""
    linears = _linears((6,), 8, torch.float64)
    x, douts = _inputs((2, 3, 8), (6,), torch.float64, 7)
    got = _run(lambda x, m: [projections.linear(x, m)], x, linears, douts)
    assert set(got) == {"out0", "dx", "dw0"}
    assert_close_set(got, _run(project_reference, x, linears, douts), 1e-12, "one projection")
    m = _linears((6,), 8, torch.float32)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = projections.linear(x.float(), m)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("case", ["bias", "mixed dtypes"])
def test_what_it_leaves_to_the_modules(case, monkeypatch):
    monkeypatch.setattr(projections._SharedInputLinears, "apply",
                        lambda *a: pytest.fail("the fused path must not serve this case"))
    linears = _linears((4, 6), 8, torch.float64, bias=case == "bias")
    if case == "mixed dtypes":
        linears[1].to(torch.float32)
    x, _ = _inputs((3, 8), (4, 6), torch.float64, 6)
    if case == "mixed dtypes":  # F.linear's own error, as the modules would raise it
        with pytest.raises(RuntimeError):
            project(x, *linears)
        return
    for got, want in zip(project(x, *linears), project_reference(x, *linears)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _two_microbatches(linears, down_weight, shared: bool):
    """Two micro-batches through project and swiglu_down under CPU autocast: (outputs and gradients,
    the casts counted)."""
    from gdn_parallel.ops.swiglu import swiglu_down
    for p in (*[m.weight for m in linears], down_weight):
        p.grad = None
    gen, outs, counter = generator(5), [], OpCounter()
    scope = projections.weights_cast_once() if shared else contextlib.nullcontext()
    with scope, torch.autocast("cpu", dtype=torch.bfloat16), counter:
        for _ in range(2):
            x = torch.randn(3, 6, 32, generator=gen)
            gate, up = project(x, *linears)
            out = swiglu_down(gate, up, down_weight)
            out.float().square().sum().backward()
            outs.append(out.detach())
    grads = [m.weight.grad.clone() for m in linears] + [down_weight.grad.clone()]
    return outs + grads, counter.calls[torch.ops.aten._to_copy.default]


def test_a_steps_microbatches_share_each_weights_cast():
    """Inside weights_cast_once each fp32 master is cast to bf16 once for both micro-batches (not once
    per micro-batch), with the same outputs and gradients, which reach the masters themselves; on exit
    the copies are dropped, so the next step casts the updated weights."""
    linears = _linears((16, 16), 32, torch.float32)
    down = nn.Parameter(torch.randn(8, 16, generator=generator(6)))
    alone, casts_alone = _two_microbatches(linears, down, shared=False)
    shared, casts_shared = _two_microbatches(linears, down, shared=True)
    for a, b in zip(alone, shared):
        assert torch.equal(a, b)
    weight_casts = 3                              # two projections and the down projection
    assert casts_alone - casts_shared == weight_casts
    assert all(g.dtype == torch.float32 for g in shared[2:])
    assert projections._shared_casts is None
    with torch.no_grad():                         # an optimizer step between two steps
        linears[0].weight.mul_(2.0)
    after, _ = _two_microbatches(linears, down, shared=True)
    assert not torch.equal(after[0], shared[0])   # the new weight, not a copy of the old one

