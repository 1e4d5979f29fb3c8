"""The gated delta rule's forward + backward at gdn-1.3b's layer shape: one micro-batch of 4 x 4096 tokens
packed as one row of six documents, 8 heads, K = 128, V = 256, bf16, the gates fused (A_log, dt_bias,
sigmoid beta) and q, k L2-normalised, as the model calls it.

    python3 tools/bench_gdn_layer.py $OUT/gdn_layer.json

Prints and writes the median wall time of a forward + backward (10 runs after 3), each kernel's time
per call (torch.profiler over 5), and every output's relative error against the PyTorch chunk path in
fp32 on the same bf16-rounded values. Run it once per source tree to compare kernel changes
(docs/kernels.md). Without CUDA it runs tiny shapes under TRITON_INTERPRET=1 in fp32 (a check of the
script itself).
"""
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.ops.gated_delta_rule import gated_delta_rule  # noqa: E402

torch.manual_seed(0)
B, T, H, K, HV, V = 1, 16384, 8, 128, 8, 256
dev = "cuda"
lens = [4096, 1500, 2596, 3000, 1096, 4096]  # packed documents, one row
if not torch.cuda.is_available():  # a dry run of the script itself (interpreter)
    T, K, V, dev, lens = 160, 16, 32, "cpu", [100, 60]
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
def inputs(dtype):
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, T, H, K, device=dev, generator=g).to(dtype)
    k = torch.randn(B, T, H, K, device=dev, generator=g).to(dtype)
    v = torch.randn(B, T, HV, V, device=dev, generator=g).to(dtype)
    a = torch.randn(B, T, HV, device=dev, generator=g).to(dtype)
    b = torch.randn(B, T, HV, device=dev, generator=g).to(dtype)
    A_log = torch.rand(HV, device=dev, generator=g) * 2
    dt_bias = torch.randn(HV, device=dev, generator=g) * 0.1 - 3
    do = torch.randn(B, T, HV, V, device=dev, generator=g).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, a, b, A_log, dt_bias)], do
def run(leaves, do, impl):
    q, k, v, a, b, A_log, dt_bias = leaves
    o, _ = gated_delta_rule(q, k, v, a, b, cu_seqlens=cu, use_qk_l2norm=True, impl=impl,
                            decay_params=(A_log, dt_bias), beta_activation="sigmoid")
    grads = torch.autograd.grad(o, leaves, do)
    return [o, *grads]
leaves, do = inputs(torch.bfloat16 if dev == "cuda" else torch.float32)
for _ in range(3):
    run(leaves, do, "triton")
torch.cuda.synchronize() if dev == "cuda" else None
times = []
for _ in range(10):
    t0 = time.perf_counter()
    run(leaves, do, "triton")
    if dev == "cuda":
        torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
times.sort()
with profile(activities=[ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        run(leaves, do, "triton")
    torch.cuda.synchronize() if dev == "cuda" else None
kern = {}
for ev in prof.key_averages():
    if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0):
        t = getattr(ev, "self_device_time_total", 0) / 1000 / 5
        if t > 0.005:
            kern[ev.key[:60]] = round(t, 4)
# accuracy: bf16 triton vs fp32 chunk path on the same (rounded) values
ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
want = run(ref_leaves, do.float(), "chunk")
got = run(leaves, do, "triton")
names = ["o", "dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"]
err = {n: ((g.float() - w).norm() / w.norm().clamp_min(1e-30)).item() for n, g, w in zip(names, got, want)}
out = {"median_ms": times[len(times) // 2], "min_ms": times[0],
       "kernels_ms": dict(sorted(kern.items(), key=lambda x: -x[1])), "rel_err_vs_fp32_chunk": err}
print(json.dumps(out, indent=1))
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
