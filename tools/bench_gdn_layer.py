"""The gated delta rule's forward + backward at gdn-1.3b's layer shape: one micro-batch of 4 x 4096 tokens
packed as one row of six documents, 8 heads, K = 128, V = 256, bf16, the gates fused (A_log, dt_bias,
sigmoid beta) and q, k L2-normalised, as the model calls it.

    python3 tools/bench_gdn_layer.py $OUT/gdn_layer.json

Prints and writes the median and least time of a forward + backward (10 runs after 3), each kernel's
time in one (torch.profiler, tools/bench_common.profile_step), and every output's relative error
against the PyTorch chunk path in fp32 on the same bf16-rounded values. Run it once per source tree to
compare kernel changes (docs/kernels.md). Without CUDA it runs tiny shapes under TRITON_INTERPRET=1 in
fp32 (a check of the script itself).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.ops.gated_delta_rule import gated_delta_rule  # noqa: E402
from tools.bench_common import profile_step, timed_ms, write_json  # noqa: E402

OUTPUT_NAMES = ["o", "dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"]


def layer_shape(device: torch.device):
    """(B, T, H, K, HV, V) and the packed documents' lengths; tiny ones for the CPU dry run."""
    if device.type == "cuda":
        return (1, 16384, 8, 128, 8, 256), [4096, 1500, 2596, 3000, 1096, 4096]
    return (1, 160, 8, 16, 8, 32), [100, 60]


def inputs(shape, dtype, device):
    B, T, H, K, HV, V = shape
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(B, T, H, K, device=device, generator=g).to(dtype)
    k = torch.randn(B, T, H, K, device=device, generator=g).to(dtype)
    v = torch.randn(B, T, HV, V, device=device, generator=g).to(dtype)
    a = torch.randn(B, T, HV, device=device, generator=g).to(dtype)
    b = torch.randn(B, T, HV, device=device, generator=g).to(dtype)
    A_log = torch.rand(HV, device=device, generator=g) * 2
    dt_bias = torch.randn(HV, device=device, generator=g) * 0.1 - 3
    do = torch.randn(B, T, HV, V, device=device, generator=g).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, a, b, A_log, dt_bias)], do


def forward_backward(leaves, do, cu, impl):
    q, k, v, a, b, A_log, dt_bias = leaves
    o, _ = gated_delta_rule(q, k, v, a, b, cu_seqlens=cu, use_qk_l2norm=True, impl=impl,
                            decay_params=(A_log, dt_bias), beta_activation="sigmoid")
    return [o, *torch.autograd.grad(o, leaves, do)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape, lens = layer_shape(device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    leaves, do = inputs(shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device)

    def step():
        forward_backward(leaves, do, cu, "triton")

    for _ in range(3):
        step()
    times = sorted(timed_ms(step, device) for _ in range(10))
    profiled = profile_step(step, device, top=40)["top"]
    kernels = {k["kernel"][:60]: k["ms"] for k in profiled if k["ms"] > 0.005}
    # accuracy: the Triton kernels against the fp32 chunk path on the same (rounded) values
    want = forward_backward([t.detach().float().requires_grad_() for t in leaves], do.float(), cu, "chunk")
    got = forward_backward(leaves, do, cu, "triton")
    err = {n: ((g.float() - w).norm() / w.norm().clamp_min(1e-30)).item()
           for n, g, w in zip(OUTPUT_NAMES, got, want, strict=True)}
    out = {"median_ms": times[len(times) // 2], "min_ms": times[0], "kernels_ms": kernels,
           "rel_err_vs_fp32_chunk": err}
    print(json.dumps(out, indent=1))
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
