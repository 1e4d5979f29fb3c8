"""gdn_kernels.wide_products: half-precision products kept in fp32. Off CUDA the product is made in
the factors' dtype and widened after (bit for bit what autograd through a cast gives); on CUDA the
product writes fp32 itself, which must then be closer to the exact product than a bf16 rounding."""
import pytest
import torch
from gdn_kernels import wide_products
from gdn_kernels.wide_products import add_product_, product_in

from tests.kernels.helpers import gpu_only
from tests.seeds import generator


def _factors(device, dtype, m=24, k=40, n=16, seed=0):
    gen = generator(seed, device)
    return (torch.randn(m, k, generator=gen, device=device).to(dtype),
            torch.randn(k, n, generator=gen, device=device).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_off_cuda_the_product_is_widened_after(dtype):
    a, b = _factors("cpu", dtype)
    got = product_in(a.t().contiguous().t(), b, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (a @ b).float(), rtol=0, atol=0)
    acc = torch.randn(24, 16, generator=generator(1))
    want = acc + (a @ b).float()
    assert add_product_(acc, a, b) is acc
    torch.testing.assert_close(acc, want, rtol=0, atol=0)


def test_same_dtype_is_a_plain_product():
    a, b = _factors("cpu", torch.float64)
    torch.testing.assert_close(product_in(a, b, torch.float64), a @ b, rtol=0, atol=0)
    acc = torch.zeros(24, 16, dtype=torch.float64)
    torch.testing.assert_close(add_product_(acc, a, b), a @ b, rtol=0, atol=0)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_product_writes_fp32(dtype):
    """The CUDA overloads are there (torch >= 2.8) and used: over a long inner dimension the fp32
    result is far closer to the exact product than the product rounded to the half dtype."""
    assert wide_products._cuda_widening_available(dtype)
    a, b = _factors("cuda", dtype, m=256, k=4096, n=192)
    exact = a.double() @ b.double()
    rounded_error = ((a @ b).double() - exact).abs().max().item()
    got = product_in(a.t().contiguous().t(), b, torch.float32)  # a transposed view, as dW = dY^T X
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max().item() < rounded_error / 8
    acc = torch.randn(256, 192, device="cuda", generator=generator(2, "cuda"))
    want = acc.double() + exact
    add_product_(acc, a, b)
    assert (acc.double() - want).abs().max().item() < rounded_error / 8
