"""Benchmark the Triton gated delta rule against fla-core and our PyTorch chunk path, in one run.

    python tools/bench_kernels.py --tokens 4096,16384,65536,262144 --out $OUT/bench_kernels.json

B=1, H heads of K=V=dim, bf16, one document per row. For each length: forward and forward+backward
milliseconds (median over --iters after --warmup, CUDA events), the ratio ours / fla-core measured
in this same run, and achieved TFLOP/s against the nominal compute floor of the forward (~176 KFLOP
per token per head at K=V=128; forward+backward is counted as 3x the forward). fla-core is timing
only: on Triton < 3.7.1 + Hopper it refuses its gated backward (fla #640) and the guard is bypassed.
With --profile, one forward+backward per length is profiled and the kernel times are listed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.ops.gated_delta_rule import gated_delta_rule  # noqa: E402
from tools.bench_common import free_memory, is_oom, timed_ms  # noqa: E402

FORWARD_FLOP_PER_TOKEN_HEAD = 176e3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,16384,65536,262144", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--torch-max-tokens", type=int, default=65536,
                   help="skip the PyTorch chunk path above this length (it is launch-bound and slow)")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--profile", action="store_true", help="list per-kernel times of ours")
    p.add_argument("--tunings", default="",
                   help="';'-separated key=value,... overrides of gdn_kernels.gated_delta_rule.TUNING to "
                        "compare (forward+backward at --tune-tokens) before the main table; the fastest "
                        "is kept, e.g. 'block_v=32;block_v=64,num_warps=8'")
    p.add_argument("--tune-tokens", type=int, default=16384)
    p.add_argument("--out", default=None, help="JSON file for the results (and a PNG beside it)")
    return p.parse_args(argv)


def make_inputs(T, H, D, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q = randn(1, T, H, D)
    k = F.normalize(randn(1, T, H, D), dim=-1)
    v = randn(1, T, H, D)
    g = F.logsigmoid(randn(1, T, H) + 3.0)
    beta = torch.sigmoid(randn(1, T, H))
    return [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v, g, beta)]


def fla_op():
    try:
        from fla.ops.common import chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as err:  # noqa: BLE001 - any import failure only drops the fla column
        print(f"fla-core not used: {type(err).__name__}: {err}")
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only (see the module docstring)
    return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


def timed(fn, warmup, iters):
    """Median CUDA-event milliseconds of fn() after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = sorted(timed_ms(fn, torch.device("cuda")) for _ in range(iters))
    return times[len(times) // 2]


def measure(op, inputs, warmup, iters):
    """(forward ms, forward+backward ms) or (inf, inf) on OOM."""
    do = torch.randn_like(inputs[2])

    def forward():
        with torch.no_grad():
            op(*inputs)

    def forward_backward():
        o = op(*inputs)
        torch.autograd.backward(o, do)
        for x in inputs:
            x.grad = None

    try:
        return timed(forward, warmup, iters), timed(forward_backward, warmup, iters)
    except Exception as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        free_memory(torch.device("cuda"))
        return float("inf"), float("inf")


def sweep_tunings(args, op):
    """Time forward+backward under each sequential-kernel setting; keep the fastest for the table."""
    import gdn_kernels.gated_delta_rule as gdn_triton
    if not args.tunings:
        return []
    inputs = make_inputs(args.tune_tokens, args.heads, args.dim, torch.device("cuda"))
    rows = []
    base = dict(gdn_triton.TUNING)
    for setting in args.tunings.split(";"):
        override = dict(kv.split("=") for kv in setting.split(",") if kv)
        override = {k: int(v) for k, v in override.items()}
        gdn_triton.TUNING.clear()
        gdn_triton.TUNING.update(base, **override)
        fwd_ms, fb_ms = measure(op, inputs, args.warmup, args.iters)
        rows.append({"tuning": dict(gdn_triton.TUNING), "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms})
        print(f"tuning {override}: fwd {fwd_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms at T={args.tune_tokens}",
              flush=True)
    best = min(rows, key=lambda r: r["fwd_bwd_ms"])
    gdn_triton.TUNING.update(best["tuning"])
    print(f"using {gdn_triton.TUNING}")
    return rows


def profile_kernels(op, inputs):
    from torch.profiler import ProfilerActivity, profile
    do = torch.randn_like(inputs[2])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        o = op(*inputs)
        torch.autograd.backward(o, do)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages()]
    return sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])[:16]


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    ops = {"ours": lambda q, k, v, g, beta: gated_delta_rule(q, k, v, g, beta, impl="triton")[0]}
    fla = None if args.no_fla else fla_op()
    if fla is not None:
        ops["fla"] = fla
    ops["torch"] = lambda q, k, v, g, beta: gated_delta_rule(q, k, v, g, beta, impl="chunk")[0]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "heads": args.heads, "dim": args.dim, "rows": [], "tunings": sweep_tunings(args, ops["ours"])}
    print(f"{results['device']}  torch {torch.__version__}  B=1 H={args.heads} K=V={args.dim} bf16")
    print(f"{'T':>7} {'op':>6} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd TF/s':>9} {'f+b TF/s':>9}")
    for T in [int(t) for t in args.tokens.split(",")]:
        inputs = make_inputs(T, args.heads, args.dim, device)
        flop = FORWARD_FLOP_PER_TOKEN_HEAD * T * args.heads * (args.dim / 128) ** 2
        row = {"tokens": T}
        for name, op in ops.items():
            if name == "torch" and T > args.torch_max_tokens:
                continue
            fwd_ms, fb_ms = measure(op, inputs, args.warmup, args.iters)
            row[name] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
                         "fwd_tflops": flop / fwd_ms / 1e9, "fwd_bwd_tflops": 3 * flop / fb_ms / 1e9}
            print(f"{T:>7} {name:>6} {fwd_ms:>9.3f} {fb_ms:>11.3f} {row[name]['fwd_tflops']:>9.1f} "
                  f"{row[name]['fwd_bwd_tflops']:>9.1f}", flush=True)
        if "fla" in row:
            row["ours_over_fla"] = {"fwd": row["ours"]["fwd_ms"] / row["fla"]["fwd_ms"],
                                    "fwd_bwd": row["ours"]["fwd_bwd_ms"] / row["fla"]["fwd_bwd_ms"]}
            print(f"{T:>7} ratio ours/fla: fwd {row['ours_over_fla']['fwd']:.2f}  "
                  f"fwd+bwd {row['ours_over_fla']['fwd_bwd']:.2f}", flush=True)
        if args.profile:
            row["kernels_ms"] = profile_kernels(ops["ours"], inputs)
            for key, ms in row["kernels_ms"]:
                print(f"        {ms:8.3f} ms  {key[:90]}")
        results["rows"].append(row)
        del inputs
        free_memory(device)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        plot(results, Path(args.out).with_suffix(".png"))


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("ours", "fla", "torch"):
        pts = [(r["tokens"], r[name]["fwd_bwd_ms"]) for r in results["rows"] if name in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="tokens (B=1)", ylabel="forward+backward ms",
           title=f"gated delta rule, H={results['heads']} K=V={results['dim']} bf16, {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
