"""swiglu_down against its autograd oracle: output and every gradient, float64 and bf16; the CPU path
(the Triton kernels, tests/kernels/test_swiglu_triton.py, serve CUDA only)."""
import pytest
import torch

import gdn_parallel.ops.swiglu as ops_swiglu
from gdn_parallel.ops.swiglu import swiglu_down, swiglu_down_reference
from tests.compare import assert_close_set
from tests.seeds import generator


def _run(fn, gate, up, weight, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (gate, up, weight)]
    out = fn(*leaves)
    out.backward(dout)
    return {"out": out.detach(), "dgate": leaves[0].grad, "dup": leaves[1].grad, "dweight": leaves[2].grad}


@pytest.mark.parametrize("shape", [(7, 12), (2, 5, 12)])
def test_matches_autograd_reference_float64(shape):
    gen = generator(3)
    gate, up = (torch.randn(*shape, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    weight = torch.randn(6, shape[-1], generator=gen, dtype=torch.float64)
    dout = torch.randn(*shape[:-1], 6, generator=gen, dtype=torch.float64)
    assert_close_set(_run(swiglu_down, gate, up, weight, dout),
                     _run(swiglu_down_reference, gate, up, weight, dout), 1e-12, f"shape {shape}")


def test_half_activations_with_fp32_weight():
    """As under autocast: bf16 gate/up, an fp32 master weight whose gradient stays fp32."""
    gen = generator(4)
    gate, up = (torch.randn(16, 32, generator=gen) for _ in range(2))
    weight, dout = torch.randn(8, 32, generator=gen), torch.randn(16, 8, generator=gen)
    got = _run(swiglu_down, gate.bfloat16(), up.bfloat16(), weight, dout.bfloat16())
    want = _run(swiglu_down_reference, gate.double(), up.double(), weight.double(), dout.double())
    assert got["dweight"].dtype == torch.float32 and got["out"].dtype == torch.bfloat16
    assert_close_set({k: v.double() for k, v in got.items()}, want, 2e-2, "bf16")


def test_weight_cast_once_and_saved_in_the_activation_dtype():
    gate, up = (torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    weight = torch.randn(8, 16, requires_grad=True)
    out = swiglu_down(gate, up, weight)
    assert [t.dtype for t in out.grad_fn.saved_tensors] == [torch.bfloat16] * 3  # not the fp32 weight
    out.sum().backward()
    assert weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_stays_on_the_torch_path(monkeypatch, dtype):
    def no_kernels(name):
        raise AssertionError(f"gdn_kernels.{name} asked for on the CPU")

    monkeypatch.setattr(ops_swiglu, "imported_kernel", no_kernels)
    gate, up = (torch.randn(3, 37, dtype=dtype, requires_grad=True) for _ in range(2))
    weight = torch.randn(5, 37, requires_grad=True)
    swiglu_down(gate, up, weight).sum().backward()
    assert gate.grad is not None and up.grad is not None and weight.grad is not None


def test_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="gate"):
        swiglu_down(torch.zeros(2, 4), torch.zeros(2, 5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="weight"):
        swiglu_down(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3, 5))
