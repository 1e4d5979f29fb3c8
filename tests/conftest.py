"""Without a GPU, Triton kernels run in Triton's interpreter. The variable is read when a kernel is
decorated, so it is set here, before any test module imports gdn_kernels.

On a GPU, fp32 operands of tl.dot default to TF32 (10-bit mantissa); the fp32 kernel tests check
the algorithm against fp32 oracles at 1e-5, so they ask for fp32-accurate products there: 3xTF32
(split operands, error ~2^-22 per product, on the tensor cores). Not IEEE: Hopper has no fp32 MMA,
and IEEE dots of 64 x 128 tiles become unrolled FMA code whose compilation took 491 s for one
K = 128 test on an H100 (3xTF32: 60 s). The precision the kernels run at in training is
measured in bf16 by tools/check_kernels_gpu.py (its own process, Triton's defaults)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ.setdefault("TRITON_F32_DEFAULT", "tf32x3")


def pytest_report_header():
    from tests.seeds import OFFSET_VARIABLE, seed_offset
    return f"{OFFSET_VARIABLE}={seed_offset()} (every test seed shifted by it; tests/seeds.py)"
