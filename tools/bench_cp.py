"""Context-parallel efficiency (weak scaling) of the model and of one GDN op (docs/design.md §2).

    torchrun --nproc_per_node=2 tools/bench_cp.py                 # 2 GPUs, defaults below
    torchrun --nproc_per_node=2 tools/bench_cp.py --smoke         # tiny, CPU, < 2 minutes

Weak scaling: CP=1 runs T_local tokens per rank with no communication (every rank its own copy;
the slowest rank counts), CP=n runs n * T_local tokens split over the n ranks. Efficiency =
t(CP=1, T_local) / t(CP=n, n * T_local); 1.0 is perfect. The model (forward + backward of the
whole network) is the headline: the relay's wavefront only shows over many layers. At op level
the whole n * T_local on one rank is timed too (speed-up = t_full / t_cpn), and fla-core's own
context parallelism when `import fla` works (CUDA only).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import (  # noqa: E402  (after the path set-up above)
    env_info,
    free_memory,
    measure,
    print_table,
    profile_step,
    setup_distributed,
    write_json,
)

from gdn_parallel.comm import CPContext  # noqa: E402  (after the path set-up above)
from gdn_parallel.config import ModelConfig  # noqa: E402  (after the path set-up above)
from gdn_parallel.data.packing import PackedBatch, pack_pieces  # noqa: E402  (after the path set-up above)
from gdn_parallel.model import HybridLM  # noqa: E402  (after the path set-up above)
from gdn_parallel.ops.gated_delta_rule import gated_delta_rule  # noqa: E402  (after the path set-up above)
from gdn_parallel.ops.rope import positions_from_cu_seqlens  # noqa: E402  (after the path set-up above)
from gdn_parallel.parallel.batch import cp_loss, shard_batch  # noqa: E402  (after the path set-up above)
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing  # noqa: E402  (after the path set-up above)

PATTERNS = {"gdn": "G", "h1": "GS"}
COLUMNS = [("level", "level", "s"), ("model/op", "name", "s"), ("algorithm", "algorithm", "s"),
           ("tokens/rank", "tokens_per_rank", "d"), ("t_cp1 ms", "t_cp1_ms", ".1f"),
           ("t_cpn ms", "t_cpn_ms", ".1f"), ("efficiency", "efficiency", ".3f"),
           ("t_full ms", "t_full_ms", ".1f"), ("speed-up", "speedup", ".2f")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def csv(kind):  # "a,b,c" -> [kind(a), kind(b), kind(c)]
        return lambda text: [kind(x) for x in text.split(",") if x]

    p.add_argument("--tokens-per-rank", type=csv(int), default=[16384, 65536])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16, help="GDN heads and attention heads")
    p.add_argument("--head-dim", type=int, default=128, help="GDN K = V (expand_v 1) and attention head dim")
    p.add_argument("--window", type=int, default=2048, help="sliding window of the S layers")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--model", type=csv(str), default=["gdn", "h1"], help="gdn (all G) and/or h1 (GS)")
    p.add_argument("--algorithms", type=csv(str), default=["relay", "allgather"])
    p.add_argument("--levels", type=csv(str), default=["model", "op"])
    p.add_argument("--docs", type=int, default=1, help="equal documents in the packed global row")
    p.add_argument("--activation-checkpointing", default="none", choices=["none", "full"],
                   help="recompute every block in the backward (long sequences per rank)")
    p.add_argument("--no-fla", action="store_true", help="skip fla-core's op even if importable")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout (a stuck peer)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "runs", "bench_cp.json"),
                   help="JSON results (default: $OUT/bench_cp.json when $OUT is set, "
                        "else runs/bench_cp.json)")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 sizes for a CPU check")
    p.add_argument("--profile", action="store_true",
                   help="also profile one model step per setting; every rank writes profile_rank<r>.json "
                        "next to --out (busy vs wall time, top kernels)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.head_dim = 2, 64, 2, 16
        args.tokens_per_rank, args.vocab, args.window = [128], 256, 32
    bad = set(args.model) - set(PATTERNS) or set(args.algorithms) - {"relay", "allgather"} \
        or set(args.levels) - {"model", "op"}
    if bad:
        p.error(f"unknown value(s) {sorted(bad)} in --model/--algorithms/--levels")
    return args


class Bench:
    """Shared state of a run: where to time, how, and the rows collected so far."""

    def __init__(self, args):
        self.args = args
        self.rank, self.world, self.device = setup_distributed(args.timeout_s)
        self.group = dist.group.WORLD
        if self.device.type == "cpu":
            # CPU runs are checks, not measurements: one thread per rank keeps ranks (and a single
            # rank's thread pool on tiny ops) from fighting over the cores.
            torch.set_num_threads(1)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.rows, self.notes, self.profiles = [], [], {}
        self.info = env_info(self.device)

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[bench_cp] {text}", flush=True)

    def time(self, label: str, step, profiled: bool = False) -> dict:
        result = measure(step, self.args.warmup, self.args.iters, self.device)
        what = "oom" if result["oom"] else f"{result['ms']:.1f} ms"
        self.log(f"{label}: {what} (peak {result['peak_gb']} GB)")
        if profiled and self.args.profile and not result["oom"]:
            self.profiles[label] = profile_step(step, self.device)
            path = os.path.join(os.path.dirname(os.path.abspath(self.args.out)),
                                f"profile_rank{self.rank}.json")
            write_json(path, self.profiles)
        return result

    def add_row(self, row: dict) -> None:
        """Record a row (efficiency / speed-up filled in when both times exist) and rewrite the
        JSON at once, so a run cut off later keeps what it measured."""
        t1, tn, tf = (row.get(key) for key in ("t_cp1_ms", "t_cpn_ms", "t_full_ms"))
        row["efficiency"] = ratio(t1, tn)
        row["speedup"] = ratio(tf, tn)
        self.rows.append(row)
        self.save(complete=False)

    def save(self, complete: bool) -> None:
        if self.rank == 0:
            write_json(self.args.out, {**self.info, "args": vars(self.args), "notes": self.notes,
                                       "complete": complete, "rows": self.rows})


def ratio(a, b):
    """a / b when both are times ("oom" / "skipped" are strings), else None."""
    return a / b if isinstance(a, float) and isinstance(b, float) else None


def ms(result: dict):
    return "oom" if result["oom"] else result["ms"]


def global_cu(total: int, docs: int) -> list:
    """Boundaries of `docs` (near-)equal documents over `total` tokens."""
    return [total * i // docs for i in range(docs + 1)]


# ---------------------------------------------------------------------------------------- model level
def model_config(args, kind: str) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layers=args.layers,
                       layer_pattern=PATTERNS[kind], gdn_num_heads=args.heads, gdn_head_dim=args.head_dim,
                       gdn_expand_v=1.0, attn_num_heads=args.heads, attn_head_dim=args.head_dim,
                       window_size=args.window)


def packed_row(total: int, docs: int, vocab: int, device) -> PackedBatch:
    """Random tokens as `docs` documents; cu_seqlens stays on the host (plans read it there)."""
    ids = torch.randint(0, vocab, (total,), generator=torch.Generator().manual_seed(0))
    cu = global_cu(total, docs)
    batch = pack_pieces([ids[a:b] for a, b in itertools.pairwise(cu)])
    return PackedBatch(batch.input_ids.to(device), batch.labels.to(device), batch.position_ids.to(device),
                       batch.cu_seqlens)


def bench_model(b: Bench, kind: str, tokens: int, model: HybridLM) -> None:
    args = b.args
    name = f"{kind}-{args.layers}L-{args.hidden}"
    batch = packed_row(tokens * b.world, args.docs, args.vocab, b.device)
    base = shard_batch(batch, b.rank, b.world, b.group)
    # CP=1: this rank's tokens as a plain single-device row (documents cut at the shard edges).
    # One document -> cu_seqlens None; else host boundaries: a device tensor would cost a host
    # sync in every layer, which the CP path (plan built once) does not pay.
    local_cu = base.context.local_cu_list
    cu = None if len(local_cu) == 2 else torch.tensor(local_cu)
    positions = None if cu is None else positions_from_cu_seqlens(cu, tokens).unsqueeze(0).to(b.device)

    def single_step():
        model.zero_grad(set_to_none=True)
        out = model(base.input_ids, labels=base.labels, cu_seqlens=cu, position_ids=positions)
        (out.loss_sum / base.num_label_tokens).backward()

    cp1 = b.time(f"model {name} T/rank={tokens} cp=1", single_step, profiled=True)
    for algorithm in args.algorithms:
        row = {"level": "model", "name": name, "algorithm": algorithm, "tokens_per_rank": tokens,
               "t_cp1_ms": ms(cp1), "peak_cp1_gb": cp1["peak_gb"]}
        if cp1["oom"]:
            # Same tokens per rank plus hand-over buffers: it would OOM too, and an OOM mid-relay
            # leaves the peers waiting on a message that never comes.
            row["t_cpn_ms"] = "skipped"
            b.add_row(row)
            continue
        shard = shard_batch(batch, b.rank, b.world, b.group, algorithm)

        def cp_step(shard=shard):
            model.zero_grad(set_to_none=True)
            cp_loss(model, shard).backward()
            shard.context.finish()

        cpn = b.time(f"model {name} T/rank={tokens} cp={b.world} {algorithm}", cp_step, profiled=True)
        b.add_row({**row, "t_cpn_ms": ms(cpn), "peak_cpn_gb": cpn["peak_gb"]})
    model.zero_grad(set_to_none=True)
    free_memory(b.device)


# ------------------------------------------------------------------------------------------- op level
def op_inputs(total: int, heads: int, dim: int, dtype, device) -> list:
    """q, k, v, g (log decay, fp32), beta, and the output gradient of the whole global row."""
    gen = torch.Generator().manual_seed(1)
    qkv = [torch.randn(1, total, heads, dim, generator=gen) for _ in range(3)]
    g = F.logsigmoid(torch.randn(1, total, heads, generator=gen))
    beta = torch.rand(1, total, heads, generator=gen).sigmoid()
    do = torch.randn(1, total, heads, dim, generator=gen)
    return [x.to(device, dtype) for x in qkv] + [g.to(device), beta.to(device, dtype), do.to(device, dtype)]


def op_step(fn, tensors: list, plan: CPContext = None):
    """Forward + backward of `fn` on leaf copies of q, k, v, g, beta (with `do` as output grad); the
    sends of `plan` (context parallelism) complete with the step."""
    *inputs, do = tensors
    leaves = [x.detach().requires_grad_() for x in inputs]

    def step():
        torch.autograd.grad(fn(*leaves), leaves, do)
        if plan is not None:
            plan.finish()
    return step


def fla_functions(b: Bench):
    """(chunk_gated_delta_rule, build_cp_context) from fla-core, or None (not importable / CPU)."""
    if b.args.no_fla or b.device.type != "cuda":
        return None
    try:
        from fla.ops.common import chunk_o
        from fla.ops.cp import build_cp_context
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as err:  # noqa: BLE001 - any import failure just means "no fla row"
        b.log(f"fla not used: {type(err).__name__}: {err}")
        return None
    # fla refuses its gated backward on Hopper with Triton < 3.7.1 (wrong results, fla #640).
    # Bypassed for timing only: fla's numbers here are timings, never a correctness reference.
    chunk_o.TRITON_ABOVE_3_7_1 = True
    b.notes.append("fla: Triton<3.7.1 Hopper guard (fla #640) bypassed; fla rows are timing-only")
    return chunk_gated_delta_rule, build_cp_context


def bench_op(b: Bench, tokens: int, fla) -> None:
    args, n = b.args, b.world
    full = op_inputs(tokens * n, args.heads, args.head_dim, b.dtype, b.device)
    start = b.rank * tokens
    local = [x[:, start:start + tokens] for x in full]
    cu_full = global_cu(tokens * n, args.docs)
    plan = CPContext.build(b.group, cu_full, tokens, device=b.device)
    cu_local = None if plan.num_local_docs == 1 else torch.tensor(plan.local_cu_list)
    cu_all = None if args.docs == 1 else torch.tensor(cu_full)
    name = f"gdn-op-H{args.heads}-K{args.head_dim}"

    def ours(cu, cp=None):
        return lambda *t: gated_delta_rule(*t, use_qk_l2norm=True, cu_seqlens=cu, cp=cp)[0]

    cp1 = b.time(f"op {name} T/rank={tokens} cp=1", op_step(ours(cu_local), local))
    one = cp1 if n == 1 else b.time(f"op {name} T={tokens * n} on one rank", op_step(ours(cu_all), full))
    for algorithm in args.algorithms:
        row = {"level": "op", "name": name, "algorithm": algorithm, "tokens_per_rank": tokens,
               "t_cp1_ms": ms(cp1), "t_full_ms": ms(one)}
        if cp1["oom"]:
            b.add_row({**row, "t_cpn_ms": "skipped"})
            continue
        # A prebuilt plan, as the model passes it: no per-call planning or host reads of cu_seqlens.
        cp = CPContext.build(b.group, cu_full, tokens, algorithm, b.device)
        cpn = b.time(f"op {name} T/rank={tokens} cp={n} {algorithm}", op_step(ours(None, cp), local, cp))
        b.add_row({**row, "t_cpn_ms": ms(cpn)})
    if fla is not None:
        bench_fla_op(b, tokens, fla, full, local, cu_full, cu_local, cu_all, name)
    free_memory(b.device)


def bench_fla_op(b: Bench, tokens, fla, full, local, cu_full, cu_local, cu_all, name) -> None:
    """The same three timings with fla-core's chunk_gated_delta_rule and its own CP."""
    chunk_gdn, build_cp_context = fla

    def single(cu):  # host copy of the boundaries given too: fla then skips its device->host read
        cu_dev = None if cu is None else cu.to(b.device)
        return lambda *t: chunk_gdn(*t, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev, cu_seqlens_cpu=cu)[0]

    def context_parallel(*t):
        return chunk_gdn(*t, use_qk_l2norm_in_kernel=True, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)[0]

    row = {"level": "op", "name": name, "algorithm": "fla-cp (timing only)", "tokens_per_rank": tokens}
    try:
        cp1 = b.time(f"op fla T/rank={tokens} cp=1", op_step(single(cu_local), local))
        one = cp1 if b.world == 1 else b.time(f"op fla T={tokens * b.world} on one rank",
                                              op_step(single(cu_all), full))
        row.update(t_cp1_ms=ms(cp1), t_full_ms=ms(one))
        if cp1["oom"]:
            row["t_cpn_ms"] = "skipped"
        else:  # built once per batch, like our plan (it reads the boundaries on the host)
            ctx = build_cp_context(torch.tensor(cu_full, device=b.device), group=b.group,
                                   conv1d_kernel_size=None)
            cpn = b.time(f"op fla T/rank={tokens} cp={b.world}", op_step(context_parallel, local))
            row["t_cpn_ms"] = ms(cpn)
    except Exception as err:  # noqa: BLE001 - fla failing is a result to report, not a crash
        b.log(f"fla failed: {type(err).__name__}: {err}")
        row["error"] = f"{type(err).__name__}: {err}"[:500]
    b.add_row(row)


def main(argv=None) -> int:
    args = parse_args(argv)
    b = Bench(args)
    b.log(f"{b.info['device']}, world {b.world}, {b.dtype}, torch {b.info['torch']}, "
          f"triton {b.info['triton']}; writing {args.out}")
    tokens_list = sorted(args.tokens_per_rank)  # small first: an OOM at the end loses least
    if "model" in args.levels:
        for kind in args.model:
            torch.manual_seed(0)
            model = HybridLM(model_config(args, kind)).to(b.device, b.dtype)
            apply_activation_checkpointing(model, args.activation_checkpointing)
            b.log(f"model {kind}: {model.config.layer_types}, "
                  f"{model.num_parameters() / 1e6:.1f} M parameters")
            for tokens in tokens_list:
                bench_model(b, kind, tokens, model)
            del model
            free_memory(b.device)
    if "op" in args.levels:
        fla = fla_functions(b)
        for tokens in tokens_list:
            bench_op(b, tokens, fla)
    b.save(complete=True)
    if b.rank == 0:
        print(f"\nCP efficiency, world {b.world} ({b.info['device']}); efficiency = t_cp1 / t_cpn, "
              f"speed-up = t_full / t_cpn" + ("".join(f"\nnote: {n}" for n in b.notes)))
        print_table(b.rows, COLUMNS)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
