"""Shared memory of every GDN kernel launch, compiled for a GPU without one: runs on any machine.

    python tools/kernel_resources.py --dims 64,128,256 --dtypes bfloat16,float32 [--arch 90]
    python tools/kernel_resources.py --block-kernels   # the conv, norm, RoPE and SwiGLU kernels

--block-kernels compiles every launch of the block's other kernels (short conv with a prefix,
documents and bias, and without an activation; the norms with and without a gate, and the
blocks' residual norms with and without a branch; RoPE; SwiGLU),
forward and backward, in each dtype: a kernel that compiles in the CPU interpreter but not for the
GPU (a tensor redefined with another shape in a branch, a libdevice call) fails here, without one.

The wrapper (gdn_kernels.gated_delta_rule) runs its forward and backward on small CPU tensors with
every Triton launch compiled for the target (sm_90: H100 / H200) instead of run. A launch whose
shared memory exceeds --limit (the H100's and H200's 227 KB per block) fails as it would on the
device, so the wrapper steps down its launch settings as there (launch.py); the table lists the
setting each kernel ends up with and its shared memory. Exit status 1 if some kernel has no
setting that fits.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HOPPER_SHARED_LIMIT = 232448  # bytes per block on the H100 and H200 (227 KB)
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64"}


@contextlib.contextmanager
def compiled_instead_of_run(arch: int, limit: int):
    """Every JITFunction launch in the block is compiled for sm_<arch>, not run: one over `limit`
    bytes of shared memory raises OutOfResources as the device would (so the wrapper steps down to
    its next launch setting, gdn_kernels.gated_delta_rule.launch); the others are appended to the
    yielded list as (kernel name, constexprs, options, shared bytes)."""
    launches = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup=False, **kwargs):
        signature, constexprs, options = signature_of(self, args, dict(kwargs))
        compiled = triton.compile(ASTSource(self, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
        shared = int(compiled.metadata.shared)
        if shared > limit:
            raise OutOfResources(shared, limit, "shared memory")
        launches.append((self.__name__, constexprs, options, shared))

    JITFunction.run = compile_only
    try:
        yield launches
    finally:
        JITFunction.run = original


def signature_of(fn: JITFunction, args, kwargs):
    """(signature, constexprs, options) of one launch, as triton.compile takes them."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip([p.name for p in fn.params], args))
    values.update(kwargs)
    signature, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs, options


def gdn_launches(K: int, V: int, dtype: torch.dtype, arch: int, limit: int, heads: int = 2,
                 tokens: int = 192):
    """The launches of one forward + backward of the Triton GDN op at these head dims and dtype."""
    from gdn_kernels.gated_delta_rule import triton_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, tokens, heads, K, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, tokens, heads, V, generator=gen).to(dtype).requires_grad_()
    g, beta = (torch.randn(1, tokens, heads, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    decay = (torch.zeros(heads, requires_grad=True), torch.zeros(heads, requires_grad=True))
    with compiled_instead_of_run(arch, limit) as launches:
        o, _ = triton_gated_delta_rule(q, k, v, g, beta, scale=K ** -0.5, cu_seqlens=[0, 100, tokens],
                                       decay_params=decay, beta_activation="sigmoid", use_qk_l2norm=True)
        o.sum().backward()
    return launches


def block_launches(dtype: torch.dtype, arch: int, limit: int) -> list:
    """The launches of one forward + backward of the conv, norm, RoPE and SwiGLU kernels."""
    from gdn_kernels import norms, rope, short_conv, swiglu
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
    with compiled_instead_of_run(arch, limit) as launches:
        x, w, b, prefix = leaf(1, 64, 16), leaf(16, 4), leaf(16), leaf(1, 3, 16)
        short_conv.triton_causal_conv1d(x, w, b, "silu", torch.tensor([0, 10, 64]), prefix).sum().backward()
        short_conv.triton_causal_conv1d(leaf(2, 8, 16), leaf(16, 4), None, None).sum().backward()
        rows, gate = leaf(6, 32), leaf(6, 32)
        norms.triton_rms_norm(rows, leaf(32), 1e-6, gate).sum().backward()
        norms.triton_rms_norm(leaf(6, 32), leaf(32), 1e-6, out_dtype=torch.bfloat16).sum().backward()
        norms.triton_l2_normalize(leaf(6, 32)).sum().backward()
        stream = leaf(6, 32).float().detach().requires_grad_()  # the residual stream stays fp32
        for branch in (None, leaf(6, 32)):
            h, y = norms.triton_residual_rms_norm(stream, branch, leaf(32), 1e-6, out_dtype=dtype)
            (h.sum() + y.sum()).backward()
        rope.triton_rotary(leaf(2, 5, 3, 8), torch.arange(5).unsqueeze(0), torch.ones(4)).sum().backward()
        g, u, dp = leaf(3, 37), leaf(3, 37), leaf(3, 37)
        swiglu.silu_mul(g, u)
        swiglu.silu_mul_backward(dp, g, u)
        swiglu.silu_mul_backward(dp.detach().clone(), g, u, with_product=True, overwrite_dp=True)
    return launches


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="16,32,64,128,256", help="head dims to try, as K = V and K < V pairs")
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    p.add_argument("--limit", type=int, default=HOPPER_SHARED_LIMIT, help="shared memory per block, bytes")
    p.add_argument("--out", default=None, help="JSON file for the table")
    p.add_argument("--block-kernels", action="store_true",
                   help="the conv, norm, RoPE and SwiGLU kernels instead")
    args = p.parse_args(argv)
    if args.block_kernels:
        for dtype_name in args.dtypes.split(","):
            for name, _, options, shared in block_launches(getattr(torch, dtype_name), args.arch, args.limit):
                print(f"{dtype_name:9s} {name:24s} {shared / 1024:7.1f} KB  {options}", flush=True)
        print(f"triton {triton.__version__}, sm_{args.arch}: the block kernels compile")
        return 0
    dims = [int(d) for d in args.dims.split(",")]
    pairs = sorted({(k, v) for k in dims for v in dims if v in (k, 2 * k)})
    rows, worst = [], 0
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for K, V in pairs:
            try:
                launches = gdn_launches(K, V, dtype, args.arch, args.limit)
            except RuntimeError as err:  # no setting of some kernel fits
                rows.append({"K": K, "V": V, "dtype": dtype_name, "fits": False, "error": str(err)})
                print(f"{dtype_name:9s} K={K:<4d} V={V:<4d} FAILS: {err}", flush=True)
                continue
            for name, constexprs, options, shared in dict.fromkeys(
                    (n, repr(c), repr(o), sh) for n, c, o, sh in launches):
                worst = max(worst, shared)
                rows.append({"kernel": name, "K": K, "V": V, "dtype": dtype_name, "shared": shared,
                             "fits": True, "setting": options, "constexprs": constexprs})
                print(f"{dtype_name:9s} K={K:<4d} V={V:<4d} {name:24s} {shared / 1024:7.1f} KB  {options}",
                      flush=True)
    over = [r for r in rows if not r["fits"]]
    print(f"triton {triton.__version__}, sm_{args.arch}: {len(rows)} launches, largest "
          f"{worst / 1024:.1f} KB, {len(over)} over the {args.limit / 1024:.0f} KB limit")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "arch": args.arch,
                                              "limit": args.limit, "launches": rows}, indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
