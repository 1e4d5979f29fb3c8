"""The block's Triton kernels compile for the H100/H200 (sm_90) on this machine, GPU or not.

The CPU tests run the kernels in Triton's interpreter, which accepts code that the GPU compiler
refuses (a tensor given another shape in a branch; libdevice calls it never makes): such a kernel
passed every CPU test once and failed on the first GPU run. tools/kernel_resources.py compiles each
launch of a forward and backward for sm_90 instead of running it (seconds per dtype).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def test_block_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    done = subprocess.run([sys.executable, "tools/kernel_resources.py", "--block-kernels", "--arch", "90",
                           "--dtypes", "bfloat16,float32"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for kernel in ("_conv_dz_kernel", "_conv_dx_kernel", "_norm_bwd", "_rotary_kernel", "_silu_mul_bwd"):
        assert kernel in done.stdout, kernel
