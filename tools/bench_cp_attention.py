"""Full attention under context parallelism, each rank's time: the contiguous split against zigzag (issue 43).

    torchrun --standalone --nproc-per-node 4 tools/bench_cp_attention.py            # 64K tokens a rank
    torchrun --standalone --nproc-per-node 4 tools/bench_cp_attention.py --docs 8   # 8 equal documents

Every rank runs the op the model's full-attention layers run under cp (`ops.attention.attention` with
the row's CPContext: the K/V all-gather, and under zigzag the query blocks' all-to-all there and the
outputs' back) forward and backward on random inputs, `--iters` times after `--warmup` (FlexAttention
compiles on the first call), timed with CUDA events on its own device. The contiguous split gives rank
r (2r + 1) / n² of the row's query-key pairs (one document); zigzag gives every rank 1/n.

Two times per rank and split. `step`: the whole op, collectives included; the ranks wait for each
other inside it (the backward's K/V gradient reduction), so every rank reads the slowest rank's time,
which is what a training step waits for. `own`: this rank's attention alone (forward + backward of
the masked attention on the queries it computes and the gathered keys, captured from one call of the
op), with no collective inside, so the ranks' times differ by their share of the work: its slowest
over the mean is the balance (1.0: balanced). JSON to --out (rank 0).

`--ranks N` without torchrun: one device runs each of N ranks' own work in turn (the same masks and
shapes, laid out by `full_attention_positions` with no message), so the balance is measured where
fewer GPUs than ranks are lent; there is no `step` time in that mode.

    python tools/bench_cp_attention.py --ranks 4 --docs 1

On CPU (gloo, `--device cpu`) the same runs with impl sdpa at any small size: the plumbing only (sdpa
computes the whole masked matrix, so both splits cost alike there).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_parallel.comm import CPContext  # noqa: E402
from gdn_parallel.ops.attention import attention  # noqa: E402
from gdn_parallel.ops.attention import cp as cp_attention_module  # noqa: E402
from gdn_parallel.ops.attention.cp import full_attention_positions  # noqa: E402

SPLITS = ("contiguous", "zigzag")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tokens-per-rank", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--docs", type=int, default=1, help="equal documents in the row")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=None,
                        help="without torchrun: time this many ranks' own work in turn on one device")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/bench_cp_attention")))
    return parser.parse_args(argv)


def _setting(args, world: int):
    """(device, dtype, impl, the row's document boundaries)."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    total = args.tokens_per_rank * world
    if total % args.docs:
        raise SystemExit(f"--docs {args.docs} does not divide the row of {total} tokens")
    cu = [total * d // args.docs for d in range(args.docs + 1)]
    on_gpu = device.type == "cuda"
    return device, torch.bfloat16 if on_gpu else torch.float32, "flex" if on_gpu else "sdpa", cu


def _head_shapes(args) -> tuple:
    """(heads, head size) of q, k and v."""
    return (args.heads, args.head_dim), (args.kv_heads, args.head_dim), (args.kv_heads, args.head_dim)


def measure(rank: int, world: int, args) -> dict:
    """{split: [this rank's milliseconds per forward + backward]} on the current process group."""
    device, dtype, impl, cu = _setting(args, world)
    gen = torch.Generator().manual_seed(1234 + rank)
    q, k, v = (torch.randn(1, args.tokens_per_rank, h, d, generator=gen).to(device, dtype)
               for h, d in _head_shapes(args))
    do = torch.randn(1, args.tokens_per_rank, args.heads, args.head_dim, generator=gen).to(device, dtype)
    times = {}
    for split in SPLITS:
        cp = CPContext.build(dist.group.WORLD, cu, args.tokens_per_rank, attention_split=split, device=device)
        memo: dict = {}
        whole_op = functools.partial(_step, (q, k, v), do, cp, impl, memo)
        step = _samples(device, args, whole_op, after=cp.finish)
        inputs = _own_work_inputs(q, k, v, cp, impl, memo)
        own = _samples(device, args, functools.partial(_own_work, inputs))
        times[split] = {"step": step, "own": own}
    return times


def measure_ranks_in_turn(world: int, args) -> list[dict]:
    """[{split: {"own": milliseconds}} for each of `world` ranks], every rank's own work (its queries
    under the split against the whole row's keys, forward + backward) run in turn on this device."""
    device, dtype, impl, cu = _setting(args, world)
    per_rank: list[dict] = [{} for _ in range(world)]
    for split in SPLITS:
        for rank in range(world):
            cp = CPContext.build(None, cu, args.tokens_per_rank, rank=rank, size=world,
                                 attention_split=split, device=device)
            q_index, q_doc, k_index, k_doc = full_attention_positions(cp, device)
            gen = torch.Generator().manual_seed(1234 + rank)
            lengths = (len(q_index), cp.total, cp.total)
            q, k, v = (torch.randn(1, n, h, d, generator=gen).to(device, dtype)
                       for n, (h, d) in zip(lengths, _head_shapes(args)))
            inputs = {"q": q, "k": k, "v": v, "do": torch.randn(q.shape, generator=gen).to(device, dtype),
                      "kwargs": {"q_index": q_index, "k_index": k_index, "q_doc": q_doc, "k_doc": k_doc,
                                 "window": None, "scale": None, "impl": impl, "memo": {}}}
            per_rank[rank][split] = {"own": _samples(device, args, functools.partial(_own_work, inputs))}
            del inputs, q, k, v
    return per_rank


def _samples(device: torch.device, args, fn, after=None) -> list[float]:
    """`fn`'s milliseconds over --iters calls after --warmup, every rank starting each call together;
    `after` (untimed) follows each call."""
    samples = []
    for i in range(args.warmup + args.iters):
        if dist.is_initialized():
            dist.barrier()
        elapsed = _timed(device, fn)
        if after is not None:
            after()
        if i >= args.warmup:
            samples.append(elapsed)
    return samples


def _step(inputs, do, cp, impl: str, memo: dict) -> None:
    q, k, v = (x.detach().requires_grad_() for x in inputs)   # fresh leaves: no gradient accumulates
    o = attention(q, k, v, causal=True, impl=impl, cp=cp, memo=memo)
    o.backward(do)


def _own_work_inputs(q, k, v, cp, impl: str, memo: dict) -> dict:
    """The arguments of this rank's masked attention in one call of the op under cp (its queries, the
    gathered keys and values, their indices and documents), and an output gradient of its shape."""
    captured: dict = {}
    real = cp_attention_module.masked_attention

    def spy(q_, k_, v_, **kwargs):
        captured.update(q=q_.detach(), k=k_.detach(), v=v_.detach(), kwargs=kwargs)
        return real(q_, k_, v_, **kwargs)

    cp_attention_module.masked_attention = spy
    try:
        with torch.no_grad():
            attention(q, k, v, causal=True, impl=impl, cp=cp, memo=memo)
        cp.finish()
    finally:
        cp_attention_module.masked_attention = real
    gen = torch.Generator().manual_seed(99)
    captured["do"] = torch.randn(captured["q"].shape, generator=gen).to(q)
    return captured


def _own_work(inputs: dict) -> None:
    leaves = [inputs[name].requires_grad_() for name in ("q", "k", "v")]
    o = cp_attention_module.masked_attention(*leaves, **inputs["kwargs"])
    o.backward(inputs["do"])
    for leaf in leaves:
        leaf.grad = None


def _timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def summarize(per_rank: list[dict]) -> dict:
    """{split: {"step_ms_per_rank", "step_slowest_ms", "own_ms_per_rank", "own_slowest_over_mean"}}
    from every rank's samples (medians)."""
    report = {}
    for split in SPLITS:
        own = [statistics.median(times[split]["own"]) for times in per_rank]
        row = {"own_ms_per_rank": own, "own_slowest_over_mean": max(own) / statistics.fmean(own)}
        if all("step" in times[split] for times in per_rank):      # not under --ranks: no collective
            step = [statistics.median(times[split]["step"]) for times in per_rank]
            row.update(step_ms_per_rank=step, step_slowest_ms=max(step))
        report[split] = row
    return report


def table(report: dict) -> str:
    lines = ["| split | step ms (slowest rank) | own ms per rank (fwd + bwd) | own: slowest / mean |",
             "|---|---|---|---|"]
    for split, row in report.items():
        ranks = ", ".join(f"{ms:.2f}" for ms in row["own_ms_per_rank"])
        balance = row["own_slowest_over_mean"]
        step = f"{row['step_slowest_ms']:.2f}" if "step_slowest_ms" in row else "-"
        lines.append(f"| {split} | {step} | {ranks} | {balance:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ranks is not None:
        if args.ranks < 1:
            raise SystemExit(f"--ranks {args.ranks}: give the number of CP ranks to lay out (>= 1)")
        _write(args, args.ranks, measure_ranks_in_turn(args.ranks, args), mode="ranks in turn on one device")
        return 0
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local}"))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        times = measure(rank, world, args)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, times)
        if rank == 0:
            _write(args, world, gathered, mode="one process a rank")
    finally:
        dist.destroy_process_group()
    return 0


def _write(args, world: int, samples: list[dict], mode: str) -> None:
    report = summarize(samples)
    print(table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    (args.out / "cp_attention.json").write_text(json.dumps(
        {"device": device, "world": world, "mode": mode,
         "settings": {k: str(v) for k, v in vars(args).items()},
         "samples": samples, "report": report, "table": table(report)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
