"""Benchmark the Triton Kimi Delta Attention kernels against fla-core's chunk_kda and our PyTorch chunk
form, in one run.

    python tools/bench_kda.py --out $OUT/bench_kda.json
    TRITON_INTERPRET=1 python tools/bench_kda.py --smoke        # CPU: checks that it starts

Each shape is heads:K:batch:tokens (K = V), bf16 (fp32 in the CPU smoke run), q and k L2-normalised,
g = logsigmoid(.) per key channel, beta = sigmoid(.), all three implementations fed the same activated
inputs. For each: forward and forward+backward milliseconds (median over --iters after one untimed
warm-up call per implementation, which is when fla-core autotunes: minutes on its first call), the ratio
fla_ms / ours_ms (above 1: ours is faster), and the relative error of our output and of fla's
against each other (they must agree to bf16 rounding in the same run, or the timing compares
different computations).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.ops.kda import kimi_delta_attention  # noqa: E402
from tools.bench_common import (  # noqa: E402
    fmt,
    free_memory,
    is_oom,
    print_table,
    profile_step,
    timed_ms,
    write_json,
)

DEFAULT_SHAPES = "16:128:8:4096,16:64:8:4096,16:256:8:4096"   # gdn-1.3b's KDA shape first
SMOKE_SHAPE = "2:16:1:80"
AGREEMENT_BOUND = 2e-2   # relative error of ours against fla-core (bf16 outputs of a 4K-token recurrence)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated heads:K:batch:tokens (K = V)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--torch-max-tokens", type=int, default=8192,
                   help="time the PyTorch chunk form only up to this many tokens per shape (batch x tokens)")
    p.add_argument("--no-fla", action="store_true", help="leave fla-core out")
    p.add_argument("--profile", action="store_true",
                   help="list the kernel times of one forward+backward of ours (and fla's) per shape")
    p.add_argument("--smoke", action="store_true",
                   help=f"one tiny shape ({SMOKE_SHAPE}), one iteration, no fla: runs on CPU under "
                        f"TRITON_INTERPRET=1")
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p.parse_args(argv)


def parse_shape(text: str) -> dict:
    try:
        heads, dim, batch, tokens = (int(x) for x in text.split(":"))
    except ValueError as err:
        raise SystemExit(f"--shapes: {text!r} is not heads:K:batch:tokens, e.g. 16:128:8:4096") from err
    return {"heads": heads, "dim": dim, "batch": batch, "tokens": tokens}


def make_inputs(shape: dict, device, dtype=torch.bfloat16, seed=0):
    """Activated KDA inputs [B, T, H, *] (q, k unit-norm; g per channel, most near 0, some strong)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, D = shape["batch"], shape["tokens"], shape["heads"], shape["dim"]

    def randn(*size):
        return torch.randn(*size, device=device, generator=gen)

    q = F.normalize(randn(B, T, H, D), dim=-1)
    k = F.normalize(randn(B, T, H, D), dim=-1)
    v = randn(B, T, H, D)
    g = F.logsigmoid(2 * randn(B, T, H, D) + 2.0)
    beta = torch.sigmoid(randn(B, T, H))
    return [x.to(dtype).requires_grad_() for x in (q, k, v)] + [g.float().requires_grad_(),
                                                                beta.to(dtype).requires_grad_()]


def our_ops(use_fla: bool) -> dict:
    """name -> fn(q, k, v, g, beta) -> o."""
    ops = {
        "triton": lambda q, k, v, g, beta: kimi_delta_attention(q, k, v, g, beta, impl="triton")[0],
        "chunk": lambda q, k, v, g, beta: kimi_delta_attention(q, k, v, g, beta, impl="chunk")[0],
    }
    if use_fla:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as err:  # noqa: BLE001 - any import failure only drops the fla column
            print(f"fla-core not used: {type(err).__name__}: {err}")
        else:
            ops["fla"] = lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]
    return ops


def median_ms(fn, iters: int, device) -> float:
    times = sorted(timed_ms(fn, device) for _ in range(iters))
    return times[len(times) // 2]


def time_op(op, inputs, iters: int, device) -> tuple:
    """(forward ms, forward+backward ms, the output of the warm-up call), or infinities on OOM."""
    do = torch.randn_like(inputs[2])

    def forward():
        with torch.no_grad():
            return op(*inputs)

    def forward_backward():
        o = op(*inputs)
        torch.autograd.backward(o, do)
        for x in inputs:
            x.grad = None

    try:
        out = forward()          # the warm-up: compilation, fla's autotuning
        forward_backward()
        return median_ms(forward, iters, device), median_ms(forward_backward, iters, device), out
    except Exception as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        free_memory(device)
        return math.inf, math.inf, None


def profile_op(op, inputs, device) -> dict:
    """Kernel times of one forward+backward (bench_common.profile_step), printed and returned."""
    do = torch.randn_like(inputs[2])

    def forward_backward():
        torch.autograd.backward(op(*inputs), do)
        for x in inputs:
            x.grad = None

    result = profile_step(forward_backward, device)
    for entry in result["top"]:
        print(f"  {entry['ms']:8.3f} ms  x{entry['calls']}  {entry['kernel']}")
    return result


def relative_error(a, b) -> float | None:
    if a is None or b is None:
        return None
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def bench_shape(shape: dict, ops: dict, args, device) -> dict:
    # fp32 on CPU: the interpreter's bf16 products are not bf16 arithmetic (tests/kernels/conftest.py)
    inputs = make_inputs(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    row = dict(shape)
    outputs = {}
    for name, op in ops.items():
        if name == "chunk" and shape["batch"] * shape["tokens"] > args.torch_max_tokens:
            continue
        fwd, fwd_bwd, outputs[name] = time_op(op, inputs, args.iters, device)
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = fwd, fwd_bwd
        print(f"{name} at {shape}: fwd {fwd:.3f} ms, fwd+bwd {fwd_bwd:.3f} ms", flush=True)
    if args.profile:
        row["profile"] = {name: profile_op(ops[name], inputs, device)
                          for name in ("triton", "fla") if name in ops}
    if "fla" in outputs:
        row["fla_over_ours_fwd"] = row["fla_fwd_ms"] / row["triton_fwd_ms"]
        row["fla_over_ours_fwd_bwd"] = row["fla_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
        row["ours_vs_fla_rel_err"] = relative_error(outputs["triton"], outputs["fla"])
    if "chunk" in outputs:
        row["ours_vs_chunk_rel_err"] = relative_error(outputs["triton"], outputs["chunk"])
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        args.shapes, args.iters, args.no_fla = SMOKE_SHAPE, 1, True
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
    else:
        raise SystemExit("bench_kda needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1 on CPU)")
    ops = our_ops(use_fla=not args.no_fla)
    rows = [bench_shape(parse_shape(s), ops, args, device) for s in args.shapes.split(",")]
    print_table(rows, [("H", "heads", "d"), ("K=V", "dim", "d"), ("B", "batch", "d"), ("T", "tokens", "d"),
                       ("ours fwd", "triton_fwd_ms", ".3f"), ("ours f+b", "triton_fwd_bwd_ms", ".3f"),
                       ("fla fwd", "fla_fwd_ms", ".3f"), ("fla f+b", "fla_fwd_bwd_ms", ".3f"),
                       ("chunk f+b", "chunk_fwd_bwd_ms", ".3f"), ("fla/ours fwd", "fla_over_ours_fwd", ".2f"),
                       ("fla/ours f+b", "fla_over_ours_fwd_bwd", ".2f"),
                       ("ours vs fla", "ours_vs_fla_rel_err", ".1e"),
                       ("ours vs chunk", "ours_vs_chunk_rel_err", ".1e")])
    disagreeing = [r for r in rows if (r.get("ours_vs_fla_rel_err") or 0) > AGREEMENT_BOUND]
    for r in disagreeing:
        print(f"WARNING: ours and fla-core disagree at {parse_shape_text(r)}: relative error "
              f"{fmt(r['ours_vs_fla_rel_err'], '.2e')} > {AGREEMENT_BOUND}")
    if args.out:
        write_json(args.out, {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                              "torch": torch.__version__, "rows": rows, "agreement_bound": AGREEMENT_BOUND})
        print(f"wrote {args.out}")
    return 1 if disagreeing else 0


def parse_shape_text(row: dict) -> str:
    return f"{row['heads']}:{row['dim']}:{row['batch']}:{row['tokens']}"


if __name__ == "__main__":
    sys.exit(main())
