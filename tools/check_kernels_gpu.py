"""GPU correctness of the Triton gated delta rule: bf16 kernels against the fp32 PyTorch chunk path.

    python tools/check_kernels_gpu.py --out $OUT/check_kernels.json

For every case: relative error (||a - e|| / ||e||) of the output, the final states and the gradients
of q, k, v, g, beta and the initial states (and of A_log, dt_bias when the kernels apply the
activations), with documents and initial states (the reference gets the fp32 originals of the inputs
rounded to bf16 for the kernels, so input rounding counts too); the same inputs run
twice must give the same bits (else a race is suspected); and one case runs with every kernel output
buffer poisoned with NaN (an element left unwritten shows up). Triton 3.6 miscompiles some gated
backward kernels on Hopper (fla #640), so this runs on the GPU every time the kernels change.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gdn_kernels.gated_delta_rule as gdn_triton  # noqa: E402

from gdn_parallel.ops.gated_delta_rule import gated_delta_rule, l2_normalize  # noqa: E402
from gdn_parallel.ops.gated_delta_rule.gates import activate_gates  # noqa: E402

NAMES = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"]
# (tokens, q/k heads, value heads, document boundaries as fractions of T, activations in the kernels:
# g and beta given as logits with A_log and dt_bias, raw q and k L2-normalised, as the model calls it)
CASES = [(4096, 16, 16, (), False), (16384, 8, 16, (0.3, 0.31), False), (16384, 16, 16, (0.5,), True),
         (65536, 4, 4, (0.5,), False), (262144, 4, 4, (0.25, 0.9), True)]


def inputs(T, H, HV, n_docs, seed, gates, dim=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    if gates:  # logits; A ~ U(1, 16) and dt_bias = softplus^-1(dt), dt ~ 1e-3..0.1, as the layer's init
        g, beta = randn(1, T, HV), randn(1, T, HV)
        dt = torch.exp(torch.rand(HV, device="cuda", generator=gen) * 4.6 - 6.9)
        extra = [torch.rand(HV, device="cuda", generator=gen).mul(15).add(1).log(),
                 dt + torch.log(-torch.expm1(-dt))]
    else:
        g, beta, extra = F.logsigmoid(randn(1, T, HV) + 3.0), torch.sigmoid(randn(1, T, HV)), []
    # raw when normalised in-kernel
    k = randn(1, T, H, dim) * 2.0 if gates else F.normalize(randn(1, T, H, dim), dim=-1)
    return [randn(1, T, H, dim), k, randn(1, T, HV, dim), g, beta,
            randn(n_docs, HV, dim, dim), randn(1, T, HV, dim), randn(n_docs, HV, dim, dim)] + extra


def run(tensors, impl, dtype, cu, fused=True):
    """fused=False: the activations in PyTorch (fp32 from the same bf16 logits), the kernels after."""
    q, k, v, g, beta, h0, do, dfinal, *decay_params = tensors
    # The model hands the op q, k, v, beta (and the logits a) in the compute dtype, a log decay g in fp32.
    g_dtype = dtype if decay_params else torch.float32
    leaves = ([x.to(dtype if i != 3 else g_dtype).detach().requires_grad_()
               for i, x in enumerate((q, k, v, g, beta))]
              + [x.detach().requires_grad_() for x in [h0] + decay_params])
    gates = dict(decay_params=tuple(leaves[6:]) or None, beta_activation="sigmoid" if decay_params else None,
                 use_qk_l2norm=bool(decay_params))
    inputs = leaves[:5]
    if not fused:
        inputs[3:5] = activate_gates(*inputs[3:5], gates["decay_params"], gates["beta_activation"])
        inputs[:2] = [l2_normalize(x) for x in inputs[:2]] if gates["use_qk_l2norm"] else inputs[:2]
        gates = {}
    o, final = gated_delta_rule(*inputs, initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                                impl=impl, **gates)
    grads = torch.autograd.grad((o.float() * do).sum() + (final * dfinal).sum(), leaves)
    return [o.detach(), final.detach(), *grads]


def rel_err(a, e):
    return ((a.double() - e.double()).norm() / e.double().norm()).item()


def check_case(T, H, HV, cuts, gates, seed, poison=False):
    bounds = sorted({0, T, *(int(c * T) for c in cuts)})
    cu = torch.tensor(bounds, device="cuda")
    tensors = inputs(T, H, HV, len(bounds) - 1, seed, gates)
    t0 = time.time()
    expected = run(tensors, "chunk", torch.float32, cu)
    t_ref = time.time() - t0
    actual = run(tensors, "triton", torch.bfloat16, cu)
    again = run(tensors, "triton", torch.bfloat16, cu)
    row = {"tokens": T, "heads": H, "value_heads": HV, "documents": len(bounds) - 1, "gates_in_kernel": gates,
           "reference_s": t_ref,
           "rel_err": {n: rel_err(a, e) for n, a, e in zip(NAMES, actual, expected)},
           "deterministic": all(torch.equal(a, b) for a, b in zip(actual, again)),
           "finite": all(bool(torch.isfinite(a).all()) for a in actual)}
    if poison:
        original = gdn_triton._buffer
        gdn_triton._buffer = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                     device=device)
        try:
            poisoned = run(tensors, "triton", torch.bfloat16, cu)
        finally:
            gdn_triton._buffer = original
        row["poisoned_buffers_equal"] = all(torch.equal(a, b) for a, b in zip(actual, poisoned))
    # dA_log and dt_bias sum a gradient over the whole sequence, with cancellation: their error against
    # fp32 grows with T whoever applies the activations. Judged against the same kernels fed
    # PyTorch's activations: fusing them must not add error.
    per_token = {n: e for n, e in row["rel_err"].items() if n not in ("dA_log", "ddt_bias")}
    row["worst"] = max(per_token.values())
    params_ok = True
    if gates:
        unfused = run(tensors, "triton", torch.bfloat16, cu, fused=False)
        row["unfused_rel_err"] = {n: rel_err(a, e) for n, a, e in zip(NAMES[8:], unfused[8:], expected[8:])}
        params_ok = all(row["rel_err"][n] <= max(1e-2, 1.25 * row["unfused_rel_err"][n]) for n in NAMES[8:])
    row["ok"] = row["worst"] < 1e-2 and params_ok and row["deterministic"] and row["finite"] \
        and row.get("poisoned_buffers_equal", True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=262144)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for i, (T, H, HV, cuts, gates) in enumerate(c for c in CASES if c[0] <= args.max_tokens):
        row = check_case(T, H, HV, cuts, gates, seed=100 + i, poison=(i in (1, 2)))
        rows.append(row)
        errs = " ".join(f"{n} {e:.1e}" for n, e in row["rel_err"].items())
        errs += "".join(f" | unfused {n} {e:.1e}" for n, e in row.get("unfused_rel_err", {}).items())
        print(f"T={T:>6} H={H} HV={HV} docs={row['documents']} gates={int(gates)} "
              f"{'OK ' if row['ok'] else 'BAD'} det={row['deterministic']} "
              f"poison={row.get('poisoned_buffers_equal', '-')} | {errs}", flush=True)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "all_ok": all(r["ok"] for r in rows)}
    print("ALL OK" if result["all_ok"] else "FAILURES")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
