"""Run parallel layouts on real devices against one device: NCCL + bf16 on GPUs (tolerance 1e-2 vs
an fp32 reference), gloo + fp32 on CPU. Prints a table and writes JSON.

    torchrun --nproc_per_node=2 tools/verify_layouts.py [--layouts tp2,pp2_1f1b,...] [--out F]

Errors are ||parallel - reference|| / ||reference|| per gradient (gathered to full shape), worst
parameter reported, and the error of all gradients taken together ("all params": one vector of every
parameter a rank holds; the worst pipeline stage). The loss is compared directly.

The bf16 criterion: the same model in bf16 on one device ("bf16 1-dev") is already ~2.5e-2 off fp32
on the GDN gate projections (b_proj, dt_bias: small gradients summed from cancelling terms) and
~2e-2 on all gradients together (2xH200, 2026-11-22), so a bare 1e-2 bound would fail the model
without any parallelism. A layout passes when its loss is within 1e-2 of fp32 and both gradient
errors are below 1e-2 or no worse than 1.5x the single-device bf16 ones: parallelism adds no error
beyond bf16 rounding.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gdn_parallel.config import ModelConfig, ParallelConfig
from gdn_parallel.data.packing import random_packed_row
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.mesh import build_mesh
from gdn_parallel.parallel.parallelize import parallelize
from gdn_parallel.parallel.tensor import full_tensor

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "pp2_1f1b": dict(pp=2),
    "pp2_interleaved": dict(pp=2, pp_schedule="interleaved", virtual_stages=2),
    "dp2_fsdp": dict(dp=2),
    "dp2_ddp": dict(dp=2, data_parallel="ddp"),
    "cp2": dict(cp=2),
    "cp2_allgather": dict(cp=2, cp_algorithm="allgather"),
    "tp2_cp2": dict(tp=2, cp=2),
    "pp2_cp2": dict(pp=2, cp=2),
    "pp2_tp2": dict(pp=2, tp=2),
    "dp2_cp2": dict(dp=2, cp=2),
    "dp2_tp2": dict(dp=2, tp=2),
    "pp2_tp2_cp2": dict(pp=2, tp=2, cp=2),
}


def packed_row(total, vocab, seed, device):
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, total, (3,), generator=gen).tolist()))
    return random_packed_row([0, *cuts, total], vocab, seed).to(device)


def norm_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(t, param, dims):
    if getattr(param, "_tp_shard_dim", None) is not None:
        return full_tensor(t, param, dims.group("tp"))
    return t.full_tensor() if isinstance(t, DTensor) else t


def verify(layout: dict, model_config: ModelConfig, device, low_precision: bool, rows_per_replica=2,
           row_len=512) -> dict:
    config = ParallelConfig(**layout)
    dims = build_mesh(config, device.type)
    torch.manual_seed(0)
    reference = HybridLM(model_config).to(device)
    single_bf16 = copy.deepcopy(reference) if low_precision else None
    dtype = torch.bfloat16 if low_precision else None
    parallel = parallelize(copy.deepcopy(reference), dims, config)
    rows = [[packed_row(row_len, model_config.vocab_size, 10 * d + m, device) for m in range(rows_per_replica)]
            for d in range(config.dp)]
    ref_loss = _single_device_loss(reference, rows, None)
    loss = parallel.train_step(rows[dims.rank("dp")], autocast_dtype=dtype)
    ref_params = dict(reference.named_parameters())
    errors = {name: norm_err(full(p.grad, p, dims), ref_params[name].grad) for name, p in parallel.named_parameters()}
    worst = max(errors, key=errors.get)
    diff_sq = sum((full(p.grad, p, dims).double() - ref_params[n].grad.double()).pow(2).sum()
                  for n, p in parallel.named_parameters())
    ref_sq = sum(ref_params[n].grad.double().pow(2).sum() for n, _ in parallel.named_parameters())
    result = {"loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
              "max_grad_err": _max_over_ranks(errors[worst], device), "worst_param_on_rank0": worst,
              "all_params_grad_err": _max_over_ranks((diff_sq / ref_sq).sqrt().item(), device)}
    if single_bf16 is not None:
        _single_device_loss(single_bf16, rows, dtype)
        single = dict(single_bf16.named_parameters())
        result["bf16_1dev_max_grad_err"] = max(norm_err(single[n].grad, ref_params[n].grad) for n in errors)
        single_diff_sq = sum((single[n].grad.double() - ref_params[n].grad.double()).pow(2).sum() for n in errors)
        result["bf16_1dev_all_params_grad_err"] = _max_over_ranks((single_diff_sq / ref_sq).sqrt().item(), device)
    return result


def _single_device_loss(model, rows, dtype):
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss_sum = sum(model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens).loss_sum
                       for replica in rows for b in replica)
    count = sum(int((b.labels != -100).sum()) for replica in rows for b in replica)
    loss = loss_sum / count
    loss.backward()
    return loss.detach()


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor(value, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="", help="comma list (default: all that fit the world size)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "runs", "verify_layouts.json"),
                        help="JSON results (default: $OUT/verify_layouts.json when $OUT is set, "
                             "else runs/verify_layouts.json)")
    parser.add_argument("--row-len", type=int, default=512)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    world = dist.get_world_size()
    names = args.layouts.split(",") if args.layouts else [
        n for n, layout in LAYOUTS.items() if ParallelConfig(**layout).world_size == world]
    model_config = ModelConfig(vocab_size=1024, hidden_size=256, n_layers=4, layer_pattern="GSAG",
                               gdn_num_heads=4, gdn_num_v_heads=8, gdn_head_dim=64, attn_num_heads=8,
                               attn_num_kv_heads=2, window_size=128)
    rows, tolerance = [], 1e-2 if cuda else 1e-5
    for name in names:
        row = {"layout": name, "precision": "bf16" if cuda else "fp32",
               **verify(LAYOUTS[name], model_config, device, cuda, row_len=args.row_len)}
        allowed = max(tolerance, 1.5 * row.get("bf16_1dev_max_grad_err", 0.0))
        allowed_all = max(tolerance, 1.5 * row.get("bf16_1dev_all_params_grad_err", 0.0))
        row["ok"] = (row["max_grad_err"] < allowed and row["loss_err"] < tolerance
                     and row["all_params_grad_err"] < allowed_all)
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        print(f"{'layout':<18}{'prec':<6}{'loss err':>10}{'all params':>12}{'max grad err':>14}"
              f"{'bf16 1-dev':>12}  ok")
        for r in rows:
            single = r.get("bf16_1dev_max_grad_err")
            print(f"{r['layout']:<18}{r['precision']:<6}{r['loss_err']:>10.2e}{r['all_params_grad_err']:>12.2e}"
                  f"{r['max_grad_err']:>14.2e}{'-' if single is None else f'{single:.2e}':>12}  {r['ok']}")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
                       "torch": torch.__version__, "tolerance": tolerance, "rows": rows}, fh, indent=1)
    dist.destroy_process_group()
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
