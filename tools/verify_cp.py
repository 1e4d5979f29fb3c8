"""Check context parallelism on real devices (NCCL on GPUs, gloo on CPU): a G/S/A HybridLM split
over the CP group against the same model on one device, fp32 (TF32 off), both algorithms, and the
bf16 autocast run against the fp32 reference. Prints a table and writes JSON.

    torchrun --nproc_per_node=2 tools/verify_cp.py [--out runs/verify_cp.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist

from gdn_parallel.config import ModelConfig
from gdn_parallel.data.packing import random_packed_row
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.batch import all_reduce_gradients, cp_loss, shard_batch


def packed_batch(cu, vocab, device, seed):
    return random_packed_row(cu, vocab, seed).to(device)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def compare(reference, model, batch, algorithm, autocast_dtype=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    reference.zero_grad()
    model.zero_grad()
    ref_loss = reference(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens).loss
    ref_loss.backward()
    shard = shard_batch(batch, rank, world, dist.group.WORLD, algorithm)
    with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = cp_loss(model, shard)
    loss.backward()
    shard.context.finish()
    all_reduce_gradients(model, dist.group.WORLD)
    dist.all_reduce(loss := loss.detach().float().clone())
    grad_errors = {name: rel_err(p.grad, p_ref.grad)
                   for (name, p_ref), p in zip(reference.named_parameters(), model.parameters())}
    worst = max(grad_errors, key=grad_errors.get)
    return {"loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "max_grad_rel_err": grad_errors[worst], "worst_param": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "runs", "verify_cp.json"),
                        help="JSON results (default: $OUT/verify_cp.json when $OUT is set, "
                             "else runs/verify_cp.json)")
    parser.add_argument("--tokens-per-rank", type=int, default=1024)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    config = ModelConfig(vocab_size=512, hidden_size=256, n_layers=6, layer_pattern="GSA", gdn_num_heads=4,
                         gdn_num_v_heads=8, gdn_head_dim=64, attn_num_heads=8, attn_num_kv_heads=2,
                         window_size=max(64, args.tokens_per_rank + 100))  # halo longer than a shard
    torch.manual_seed(0)
    reference = HybridLM(config).to(device)
    model = copy.deepcopy(reference)
    total = args.tokens_per_rank * world
    layouts = {"one_document": [0, total],
               "documents": [0, 100, total // 2 + 7, total // 2 + 9, total - 1, total]}
    rows = []
    for layout, cu in layouts.items():
        batch = packed_batch(cu, config.vocab_size, device, seed=len(rows))
        for algorithm in ("relay", "allgather"):
            for precision in (["fp32", "bf16"] if cuda else ["fp32"]):
                dtype = torch.bfloat16 if precision == "bf16" else None
                row = {"layout": layout, "algorithm": algorithm, "precision": precision,
                       **compare(reference, model, batch, algorithm, dtype)}
                row["ok"] = row["max_grad_rel_err"] < (1e-2 if dtype else 1e-4) and row["loss_rel_err"] < 1e-2
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
                       "torch": torch.__version__, "rows": rows}, fh, indent=1)
        print(f"{'layout':<14}{'algorithm':<11}{'prec':<6}{'loss err':>10}{'max grad err':>14}  ok")
        for r in rows:
            print(f"{r['layout']:<14}{r['algorithm']:<11}{r['precision']:<6}{r['loss_rel_err']:>10.2e}"
                  f"{r['max_grad_rel_err']:>14.2e}  {r['ok']}")
    dist.destroy_process_group()
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
