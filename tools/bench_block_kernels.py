"""The memory-bound Triton kernels of a block at training shapes: the short conv, the row norms and the
rotary embedding, forward and backward, against the bytes they must move, with their tile settings
swept, in one run.

    python tools/bench_block_kernels.py --out $OUT/bench_block_kernels.json [--baseline OLD_MODULE.py]

Shapes are gdn-1.3b's at a micro-batch of 4 x 4096 tokens: the q/k conv (1024 channels) and the v conv
(2048), bf16 with SiLU and four documents per row, each with a bf16 and with an fp32 weight; the
pre-norm RMSNorm over the fp32 residual stream (hidden 2048, bf16 output) and the gated output norm
(rows of one head, 256 values, bf16); the rotary embedding of h1-1.3b's queries (16 heads of 128) at
positions from 0 and near the end of a 1M-token sequence, whose ratio shows what the angle's range
reduction costs there. Each case is
first checked against the PyTorch path in fp32 on the same rounded inputs (output and every gradient),
then timed (median of --iters after --warmup, CUDA events; and the kernels' own time of one forward +
backward from torch.profiler, without the host's gaps between launches). GB/s counts each tensor the
op must read or write once (inputs, outputs and gradients); the H100's HBM3 moves about 3.35 TB/s.

Each tile setting is a set of module constants of gdn_kernels.short_conv / gdn_kernels.norms, set
for its rows and restored after; the fastest is printed with its ratio to the module's current
setting. --baseline FILE imports FILE as a second short-conv module and times it beside the current
one (e.g. the version before a change: `git show REV:kernels/short_conv.py > old.py`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.model.norm import rms_norm  # noqa: E402
from gdn_parallel.ops.rope import apply_rotary  # noqa: E402
from gdn_parallel.ops.short_conv import causal_conv1d  # noqa: E402
from gdn_parallel.ops.triton_dispatch import kernel_module  # noqa: E402
from gdn_parallel.verify.compare import relative_error  # noqa: E402
from tools.bench_common import profile_step, timed_ms  # noqa: E402

CONV_SETTINGS = [  # DZ_BLOCK_T, DZ_WARPS, CHUNK_T; BLOCK_T, TILES_PER_PROGRAM (the forward's and dx pass's)
    {}, {"DZ_BLOCK_T": 32}, {"DZ_BLOCK_T": 32, "DZ_WARPS": 8}, {"CHUNK_T": 128}, {"CHUNK_T": 512},
    {"BLOCK_T": 64}, {"BLOCK_T": 16}, {"TILES_PER_PROGRAM": 1}, {"TILES_PER_PROGRAM": 2},
    {"TILES_PER_PROGRAM": 8}, {"BLOCK_T": 16, "TILES_PER_PROGRAM": 8}]
NORM_SETTINGS = [  # kernels/norms.py's BWD_* constants; {} is the module's own choice
    {}, {"BWD_ROWS_PER_PROGRAM_WIDE": 4, "BWD_NARROW_WARPS": 8},   # the settings before 2026-11-26
    {"BWD_STAGES": 2}, {"BWD_STAGES": 3}, {"BWD_ROWS_PER_PROGRAM_WIDE": 8},
    {"BWD_ROWS_PER_PROGRAM_WIDE": 32}, {"BWD_ROWS_PER_PROGRAM": 8}, {"BWD_ROWS_PER_PROGRAM": 16},
    {"BWD_NARROW_WARPS": 2}, {"BWD_WARPS": 16}, {"BWD_ELEMENTS": 1024}, {"BWD_ELEMENTS": 4096}]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--baseline", default="", help="a short-conv module file to time beside the current one")
    p.add_argument("--device", default="cuda", help="cpu: a check of this script under TRITON_INTERPRET=1")
    p.add_argument("--out", default="runs/bench_block_kernels.json")
    return p.parse_args(argv)


@contextlib.contextmanager
def constants(module, values: dict):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def median_ms(step, warmup, iters, device) -> float:
    for _ in range(warmup):
        step()
    return statistics.median(timed_ms(step, device) for _ in range(iters))


def forward_backward_ms(fn, inputs, grad_out, warmup, iters):
    """(forward ms, forward + backward ms, the kernels' own ms of a forward + backward or None off CUDA)
    of fn(*inputs). The first two are spans between CUDA events, so they include the gaps where the
    GPU waits for the host's launches; the third sums the kernels' durations (torch.profiler), which
    tells a slower kernel from a slower host."""
    device = grad_out.device
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def forward():
        with torch.no_grad():
            fn(*inputs)

    def both():
        torch.autograd.grad(fn(*inputs), leaves, grad_out)
    fwd, whole = median_ms(forward, warmup, iters, device), median_ms(both, warmup, iters, device)
    return fwd, whole, profile_step(both, device)["busy_ms"] if device.type == "cuda" else None


def check(fn, reference, inputs, grad_out, tol) -> dict:
    """Output and every gradient of fn against reference on fp32 copies of the same inputs."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got = [fn(*inputs)]
    got += torch.autograd.grad(got[0], leaves, grad_out)
    ref_inputs = [t.detach().float().requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad
                  else t for t in inputs]
    ref_leaves = [t for t in ref_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    ref = [reference(*ref_inputs)]
    ref += torch.autograd.grad(ref[0], ref_leaves, grad_out.float())
    errors = [relative_error(a, r) for a, r in zip(got, ref)]
    return {"rel_errors": errors, "ok": all(e < tol for e in errors)}


def conv_cases(args, device):
    """Each shape with a bf16 weight and with the fp32 master weight the model passes under autocast
    (since 2026-11-29; the kernels read either in fp32)."""
    B, T = args.batch, args.tokens
    cu = torch.tensor([0, T // 8, T // 2, T // 2 + 3, T], device=device)  # packed rows need B = 1
    for D in (1024, 2048):
        gen = torch.Generator(device=device).manual_seed(D)
        x = torch.randn(1, B * T, D, device=device, generator=gen).bfloat16().requires_grad_()
        w32 = torch.randn(D, 4, device=device, generator=gen) * 0.5
        dy = torch.randn(1, B * T, D, device=device, generator=gen).bfloat16()
        cu_all = torch.cat([cu[:-1] + r * T for r in range(B)] + [cu[-1:] + (B - 1) * T])
        for name, w in (("bf16", w32.bfloat16()), ("fp32", w32)):
            # x, dy, dx, y once each (bf16)
            inputs = (x, w.requires_grad_(), None, "silu", cu_all)
            yield f"conv D={D}, {name} weight", inputs, dy, 4 * x.numel() * 2


def norm_cases(args, device):
    rows = args.batch * args.tokens
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, 2048, device=device, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(2048, device=device, generator=gen)).requires_grad_()
    dy = torch.randn(rows, 2048, device=device, generator=gen).bfloat16()
    # x fp32 read, y bf16 written, dy bf16 read, dx fp32 written
    yield "rmsnorm 2048 (fp32 in, bf16 out)", (x, w, 1e-6, None, torch.bfloat16), dy, rows * 2048 * 12
    heads = 8
    xo = torch.randn(rows * heads, 256, device=device, generator=gen).bfloat16().requires_grad_()
    go = torch.randn(rows * heads, 256, device=device, generator=gen).bfloat16().requires_grad_()
    wo = (1 + 0.1 * torch.randn(256, device=device, generator=gen)).requires_grad_()
    dyo = torch.randn(rows * heads, 256, device=device, generator=gen).bfloat16()
    # x, gate, y, dy, dx, dgate (bf16)
    yield "gated norm 256 (bf16)", (xo, wo, 1e-6, go), dyo, rows * heads * 256 * 12


def residual_norm_case(args, device):
    """The blocks' pre-norm: h = x + branch (the fp32 stream and a bf16 branch), then normalised. Bytes:
    x, branch read and h, y written; h, dy read and dx, dbranch written."""
    rows = args.batch * args.tokens
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(rows, 2048, device=device, generator=gen).requires_grad_()
    branch = torch.randn(rows, 2048, device=device, generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(2048, device=device, generator=gen)).requires_grad_()
    dy = torch.randn(rows, 2048, device=device, generator=gen).bfloat16()
    return "residual norm 2048 (fp32 + bf16)", (x, w, 1e-6, branch), dy, rows * 2048 * 22


ROPE_STARTS = (0, 786_432)   # positions from 0, and the last CP rank's quarter of a 1M-token document


def rope_cases(args, device):
    """One case for each of ROPE_STARTS. x, y, dy and dx once each (bf16)."""
    rows, heads, dim = args.batch * args.tokens, 16, 128
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(1, rows, heads, dim, device=device, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(1, rows, heads, dim, device=device, generator=gen).bfloat16()
    for start in ROPE_STARTS:
        positions = torch.arange(start, start + rows, device=device)
        yield f"rope 16x128, positions from {start}", (x, positions), dy, 4 * x.numel() * 2


def rope_fn(rope):
    def fn(x, positions):
        inv_freq = 10000.0 ** (-torch.arange(0, 128, 2, device=x.device, dtype=torch.float32) / 128)
        return rope.triton_rotary(x, positions.unsqueeze(0), inv_freq)
    return fn


def rope_reference(x, positions):
    return apply_rotary(x, positions, 10000.0, impl="torch")


def conv_fn(module):
    def fn(x, w, b, activation, cu):
        return module.triton_causal_conv1d(x, w, b, activation, cu)
    return fn


def conv_reference(x, w, b, activation, cu):
    return causal_conv1d(x, w, b, activation, cu, impl="torch")


def norm_fn(x, w, eps, gate=None, out_dtype=None):
    return rms_norm(x, w, eps, gate, out_dtype)


def residual_norm_fn(module):
    def fn(x, w, eps, branch):
        return module.triton_residual_rms_norm(x, branch, w, eps, torch.bfloat16)[1]
    return fn


def residual_norm_reference(x, w, eps, branch):
    return norm_reference(x + branch, w, eps)


def norm_reference(x, w, eps, gate=None, out_dtype=None):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return y if gate is None else y * torch.nn.functional.silu(gate.float())


def sweep(name, module, settings, fn, reference, inputs, grad_out, bytes_moved, args, rows):
    for setting in settings:
        with constants(module, setting):
            row = {"case": name, "setting": setting, **check(fn, reference, inputs, grad_out, 2e-2)}
            fwd, both, kernels = forward_backward_ms(fn, inputs, grad_out, args.warmup, args.iters)
        row.update(forward_ms=fwd, backward_ms=both - fwd, forward_backward_ms=both,
                   gb_per_s=bytes_moved / both / 1e6, kernels_ms=kernels)
        rows.append(row)
        own = "" if kernels is None else f"  kernels {kernels:7.3f} ms"
        print(f"{name:34s} {json.dumps(setting):48s} fwd {fwd:7.3f} ms  bwd {both - fwd:7.3f} ms{own}  "
              f"{row['gb_per_s']:7.0f} GB/s  errors {' '.join(f'{e:.1e}' for e in row['rel_errors'])}"
              + ("" if row["ok"] else "  WRONG"), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    conv, norms = kernel_module("short_conv"), kernel_module("norms")
    rows: list = []
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("gdn_kernels.baseline_short_conv", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    for name, inputs, dy, nbytes in conv_cases(args, device):
        if baseline is not None:
            sweep(f"{name} baseline", baseline, [{}], conv_fn(baseline), conv_reference, inputs, dy, nbytes,
                  args, rows)
        sweep(name, conv, CONV_SETTINGS, conv_fn(conv), conv_reference, inputs, dy, nbytes, args, rows)
    for name, inputs, dy, nbytes in norm_cases(args, device):
        sweep(name, norms, NORM_SETTINGS, norm_fn, norm_reference, inputs, dy, nbytes, args, rows)
    name, inputs, dy, nbytes = residual_norm_case(args, device)
    sweep(name, norms, NORM_SETTINGS, residual_norm_fn(norms), residual_norm_reference, inputs, dy, nbytes,
          args, rows)
    rope = kernel_module("rope")
    for name, inputs, dy, nbytes in rope_cases(args, device):
        sweep(name, rope, [{}], rope_fn(rope), rope_reference, inputs, dy, nbytes, args, rows)
    print()
    near, far = (next(r for r in rows if r["case"].startswith("rope") and r["case"].endswith(f" {s}"))
                 for s in ROPE_STARTS)
    ratio = far["forward_backward_ms"] / near["forward_backward_ms"]
    print(f"rope far / near positions: {ratio:.2f}x the time")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case and r["ok"]]
        if not mine:
            print(f"{case}: no setting matched the reference")
            continue
        best, current = min(mine, key=lambda r: r["forward_backward_ms"]), mine[0]
        own = "" if current["kernels_ms"] is None else f" (its kernels {current['kernels_ms']:.3f} ms)"
        print(f"{case:34s} best {json.dumps(best['setting'])}: {best['forward_backward_ms']:.3f} ms, "
              f"{current['forward_backward_ms'] / best['forward_backward_ms']:.2f}x the current setting{own}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    Path(args.out).write_text(json.dumps({"device": name,
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    return 1 if any(not r["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
