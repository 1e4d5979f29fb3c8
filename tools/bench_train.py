"""Training-step benchmark on one GPU: our HybridLM against fla-core's GatedDeltaNetForCausalLM, one run.

    python tools/bench_train.py --configs configs/gdn-1.3b.yaml --batches 2,8 --micro 2 \\
        --out $OUT/bench_train.json

For each config and batch size: one optimizer step = batch / micro sequences per forward/backward
(gradient accumulation), bf16 autocast over fp32 weights, fused AdamW, random tokens, one document
per row. Reported: step time (median of --iters after --warmup, synchronised), tokens/s, MFU (our FLOP
formula, HybridLM.flops_per_token: 6 per matmul parameter + the token mixers, over the device's
dense bf16 peak) and peak memory (torch.cuda.max_memory_allocated over the timed steps, weights and
optimizer state included). The peer row is fla-core's model with the same shapes and its fused
linear cross-entropy (pure GDN configs only: its attention layers need flash-attn); it is skipped
when fla-core is not importable. Out-of-memory is reported as such.

--trainer N: first, per config, the trainer as users run it (`python -m gdn_parallel.train --config
C`, its own batch, micro-batches, data, clipping and logging, N steps, checkpoints off), steps N-4 and
N-3 under train.profile_steps, logging at the config's train.log_every (N >= 2 x log_every + 5): its
steady tokens/s (median of the logged lines none of whose steps warms up, is profiled or follows
them), MFU, peak memory, and the profile's GPU-idle share and time buckets, beside the bare steps;
also the idle share of the steady steps (the profile's busy time against their wall time: the
profiler's own work slows the host, so on a slow host the profiled steps idle more than the others).

--account: one forward of our model per config at --account-batch sequences, with every tensor saved
for the backward counted once (by storage) and charged to the module that saved it: where the
activation memory goes, per block component. Then, per --ac mode and --account-seq-lens context, one
measured training step split into weights, gradients, optimizer state, what the forward keeps, each
recomputed block's working set and the loss (tools/memory_account.py), beside the memory model's
prediction (gdn_parallel/train/memory_model.py); --offload N adds the same with
train.activation_offload=cpu over N blocks (0: all). Printed as tables and kept in the JSON.
Variants of our model: --ac none,selective,full (activation checkpointing).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.config import Config  # noqa: E402
from gdn_parallel.model import HybridLM  # noqa: E402
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing  # noqa: E402
from gdn_parallel.train.metrics_sinks import read_metrics  # noqa: E402
from gdn_parallel.train.profiling import steady_idle_share  # noqa: E402
from gdn_parallel.train.progress import peak_flops_per_s  # noqa: E402
from tools.bench_common import free_memory, is_oom, median_step_ms, steady_records, timed_ms  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="configs/gdn-1.3b.yaml")
    p.add_argument("--batches", default="2",
                   help="comma-separated optimizer batch sizes (sequences) of the bare steps; \"\": none")
    p.add_argument("--micro", type=int, default=0, help="sequences per forward/backward (0: the whole batch)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: the config's)")
    p.add_argument("--ac", default="none", help="comma-separated activation checkpointing modes of ours")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--peer-micro", type=int, default=0,
                   help="fla-core's sequences per forward/backward where --micro does not fit (0: --micro)")
    p.add_argument("--trainer", type=int, default=0, metavar="STEPS",
                   help="also time the real trainer over STEPS steps per config (>= 2 x its "
                        "train.log_every + 5; 0: not)")
    p.add_argument("--trainer-set", action="append", default=[], metavar="KEY=V[;KEY=V...]",
                   help="a variant of the trainer rows: these --set overrides (repeatable: one variant each)")
    p.add_argument("--account", action="store_true", help="per-component account of saved activations")
    p.add_argument("--account-batch", type=int, default=2)
    p.add_argument("--account-seq-lens", default="",
                   help="comma-separated contexts of the measured steps of --account (\"\": the config's)")
    p.add_argument("--offload", type=int, default=None, metavar="BLOCKS",
                   help="--account: also measure with activation offload over BLOCKS blocks (0: all)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "runs"), "bench_train.json"))
    return p.parse_args(argv)


TRAINER_TIMEOUT_S = 300  # a trainer row that hangs must not take the rest of the run with it


def trainer_row(path: str, steps: int, out: str, overrides: tuple[str, ...] = ()) -> dict:
    """The trainer's own steps at the config's settings (and `overrides`, KEY=VALUE), in a process of
    its own (module docstring)."""
    import statistics
    import subprocess
    train = Config.from_yaml(path, list(overrides)).train
    if steps < 2 * train.log_every + 5:  # a logged interval after the warm-up, before the profiled steps
        raise SystemExit(f"--trainer {steps}: {Path(path).name} logs every {train.log_every} steps, so "
                         f"give at least {2 * train.log_every + 5} (a logged interval of steady steps "
                         f"after steps 0-1, before the profiled steps {steps - 4}-{steps - 3})")
    variant = "-".join(o.replace("=", "_").replace(".", "_") for o in overrides)
    run_dir = Path(out).parent / "bench_trainer" / (Path(path).stem + (f"-{variant}" if variant else ""))
    window = f"{steps - 4},{steps - 3}"
    command = [sys.executable, "-m", "gdn_parallel.train", "--config", path, "--set", f"train.steps={steps}",
               "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
               "--set", "checkpoint.enabled=false", "--set", f"train.out_dir={run_dir}",
               "--set", f"train.profile_steps={window}", *[x for o in overrides for x in ("--set", o)]]
    try:
        done = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                              text=True, timeout=TRAINER_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        return {"model": "trainer", "batch": 0, "micro": 0, "command": " ".join(command[1:]),
                "error": f"no result within {TRAINER_TIMEOUT_S} s: {str(err.stdout or '')[-300:]}"}
    row = {"model": "trainer" + (f" {' '.join(overrides)}" if overrides else ""), "batch": train.batch_size,
           "micro": train.microbatch_rows, "command": " ".join(command[1:])}
    if done.returncode != 0:
        return {**row, "error": (done.stdout + done.stderr)[-600:]}
    records = read_metrics(run_dir / "metrics.jsonl")
    lines = [r for r in records if "tokens_per_s" in r and isinstance(r.get("step"), int)]
    # The config's own train.log_every (a line reads the device: logging every step would hide host
    # waits); a line counts where none of the steps it covers warms up, is profiled or follows them.
    # (The profiler starts one step early, at steps - 5, whose time its start-up inflates.)
    steady = steady_records(lines, (steps - 5, steps - 3))
    if not steady:
        return {**row, "error": f"no steady logged interval in {steps} steps (lines at "
                                f"{[r['step'] for r in lines]})"}
    profile = json.loads((run_dir / "profile" / "buckets_rank0.json").read_text())
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    step_ms = median_step_ms(steady)
    return {**row, "tokens_per_s": tokens_per_s, "step_ms": step_ms, "mfu": statistics.median(
                r["mfu"] or 0.0 for r in steady) or None,
            "peak_gib": max(r["mem_mib"] for r in lines) / 1024, "idle_share": profile["idle_share"],
            "idle_share_steady": (None if profile["idle_share"] is None  # a CPU run: no kernel time
                                  else steady_idle_share(profile["busy_ms"], step_ms)),
            "profile_wall_ms": profile["wall_ms"], "buckets_ms": profile["buckets_ms"],
            "top_kernels": profile["top"]}


def random_rows(batch: int, seq_len: int, vocab: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len + 1), device=device, generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def ours(config: Config, ac: str, device):
    model = HybridLM(config.model).to(device)
    apply_activation_checkpointing(model, ac)

    def loss_sum(ids, labels):
        rows, T = ids.shape
        cu = torch.arange(0, (rows + 1) * T, T, device=device, dtype=torch.int32)
        out = model(ids.reshape(1, -1), labels=labels.reshape(1, -1), cu_seqlens=cu.cpu())
        return out.loss_sum

    return model, loss_sum, model.flops_per_token(config.train.seq_len)


def fla_peer(config: Config, device):
    """fla-core's GatedDeltaNetForCausalLM with our shapes, or None where it cannot run them."""
    m = config.model
    if set(m.layer_types) != {"G"}:
        return None
    try:
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    except Exception as err:  # noqa: BLE001 - any import failure means: no peer in this run
        print(f"fla-core not used: {type(err).__name__}: {err}")
        return None
    peer_config = GatedDeltaNetConfig(
        hidden_size=m.hidden_size, num_hidden_layers=m.n_layers, num_heads=m.gdn_num_heads,
        num_v_heads=m.num_v_heads, head_dim=m.gdn_head_dim, expand_v=m.gdn_expand_v, conv_size=m.conv_size,
        use_gate=m.gdn_use_gate, intermediate_size=m.mlp_dim, vocab_size=m.vocab_size, norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_word_embeddings, fuse_cross_entropy=False, fuse_linear_cross_entropy=True)
    from fla.ops.common import chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True  # timing and memory only: its Triton<3.7.1 Hopper guard (fla #640)
    model = GatedDeltaNetForCausalLM(peer_config).to(device)

    def loss_sum(ids, labels):
        out = model(input_ids=ids, labels=labels)  # it shifts the labels itself: same work, other value
        return out.loss * labels.numel()

    return model, loss_sum


def step_fn(model, loss_sum, optimizer, rows, micro):
    ids, labels = rows
    pieces = range(0, ids.shape[0], micro)
    count = labels.numel()

    def step():
        for start in pieces:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_sum(ids[start:start + micro], labels[start:start + micro]) / count
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(name, model, loss_sum, flops_per_token, batch, micro, seq_len, vocab, args, device):
    row = {"model": name, "batch": batch, "micro": micro, "seq_len": seq_len}
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        step = step_fn(model, loss_sum, optimizer, random_rows(batch, seq_len, vocab, device), micro)
        step()  # compile and autotune
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.warmup):
            step()
        times = sorted(timed_ms(step, device) for _ in range(args.iters))
        ms = times[len(times) // 2]
        tokens_per_s = batch * seq_len / (ms / 1e3)
        peak = peak_flops_per_s(argparse.Namespace(peak_tflops=0.0), device)
        row.update(step_ms=ms, tokens_per_s=tokens_per_s,
                   peak_gib=torch.cuda.max_memory_allocated(device) / 2 ** 30,
                   mfu=flops_per_token * tokens_per_s / peak if peak and flops_per_token else None)
    except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others' rows
        if is_oom(err):
            row.update(oom=True)
        else:
            row.update(error=f"{type(err).__name__}: {str(err)[:500]}")
    return row


def account_saved_activations(config: Config, batch: int, device) -> dict:
    """Bytes saved for the backward by one forward, per module path with layer indices folded."""
    model = HybridLM(config.model).to(device)
    stack, charged, seen = ["(model)"], collections.Counter(), set()

    def push(module, _args, name):
        stack.append(name)

    def pop(module, _args, _out):
        stack.pop()

    for name, module in model.named_modules():
        if name:
            folded = ".".join("*" if part.isdigit() else part for part in name.split("."))
            module.register_forward_pre_hook(lambda m, a, n=folded: push(m, a, n))
            module.register_forward_hook(pop)

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen and t.untyped_storage().nbytes():
                seen.add(key)
                charged[stack[-1]] += t.untyped_storage().nbytes()
            # detached: a saved output held by the hook with its own grad_fn is a cycle through the
            # autograd graph that Python's collector cannot see, and the graph (no backward runs here)
            # would outlive the call: 14 GiB of a 1.3b model's device memory did
            return t.detach()
        return t

    ids, labels = random_rows(batch, config.train.seq_len, config.model.vocab_size, device)
    cu = torch.arange(0, (batch + 1) * config.train.seq_len, config.train.seq_len, dtype=torch.int32)
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cuda", dtype=torch.bfloat16)):
        out = model(ids.reshape(1, -1), labels=labels.reshape(1, -1), cu_seqlens=cu)
    del out
    total = sum(charged.values())
    return {"batch": batch, "seq_len": config.train.seq_len, "total_gib": total / 2 ** 30,
            "by_module_mib": {k: v / 2 ** 20 for k, v in charged.most_common()}}


def step_accounts(path: str, args, device) -> list[dict]:
    """tools/memory_account.py's measured steps of one config (module docstring)."""
    from tools.memory_account import account_step
    rows = []
    lengths = [int(n) for n in args.account_seq_lens.split(",") if n] or [0]
    for ac in args.ac.split(","):
        for seq_len in lengths:
            for offload in [None] + ([args.offload] if args.offload is not None and ac == "full" else []):
                config = Config.from_yaml(path, [f"train.activation_checkpointing={ac}"]
                                          + ([f"train.seq_len={seq_len}"] if seq_len else []))
                try:
                    row = account_step(config, 1, device, offload)
                except Exception as err:  # noqa: BLE001 - an OOM at one context must not lose the others
                    row = {"seq_len": config.train.seq_len, "activation_checkpointing": ac,
                           "offload_blocks": offload, "error": f"{type(err).__name__}: {str(err)[:300]}"}
                rows.append(row)
                print(json.dumps({"config": path, **{k: v for k, v in row.items()
                                                     if k != "backward_segments"}}), flush=True)
                free_memory(device)
    return rows


def print_step_accounts(path: str, rows: list[dict]) -> None:
    print(f"\nmemory of one step, {Path(path).name} (GiB; predicted = gdn_parallel/train/memory_model.py)")
    print(f"{'ac':9s} {'offload':>7s} {'tokens':>8s} {'weights':>7s} {'optim':>6s} {'kept':>6s} "
          f"{'ws G':>6s} {'ws S/A':>6s} {'peak':>6s} {'predicted':>9s} {'error':>6s} {'reserved':>8s} "
          f"{'tok/s':>8s}")
    for r in rows:
        if r.get("error"):
            print(f"{r['activation_checkpointing']:9s} {str(r['offload_blocks']):>7s} {r['seq_len']:8d}  "
                  f"{r['error']}")
            continue
        ws = r["block_working_set_gib"]
        other = max([v for k, v in ws.items() if k != "G"], default=0.0)
        print(f"{r['activation_checkpointing']:9s} {str(r['offload_blocks']):>7s} {r['seq_len']:8d} "
              f"{r['weights_gib']:7.2f} {r['optimizer_state_gib']:6.2f} {r['kept_for_backward_gib']:6.2f} "
              f"{ws.get('G', 0.0):6.2f} {other:6.2f} {r['peak_gib']:6.2f} {r['predicted']['peak_gib']:9.2f} "
              f"{r['prediction_error']:+6.1%} {r['reserved_gib']:8.2f} {r['tokens_per_s']:8,.0f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda")
    results, accounts = [], {}

    def write_payload() -> dict:  # after every row: a run stopped part-way keeps what it measured
        payload = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                   "results": results, "accounts": accounts}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=1))
        return payload

    for path in args.configs.split(","):
        config = Config.from_yaml(path)
        seq_len = args.seq_len or config.train.seq_len
        config.train.seq_len = seq_len
        for variant in [()] + [tuple(v.split(";")) for v in args.trainer_set] if args.trainer else []:
            results.append({"config": path, **trainer_row(path, args.trainer, args.out, variant)})
            print(json.dumps(results[-1]), flush=True)
            write_payload()
        if args.account:  # the measured steps first: they start from an empty device
            steps = step_accounts(path, args, device)
            accounts[path] = {**account_saved_activations(config, args.account_batch, device), "steps": steps}
            free_memory(device)
            write_payload()
        for batch in [int(b) for b in args.batches.split(",") if b]:  # "": trainer rows only
            micro = args.micro or batch
            for ac in args.ac.split(","):
                model, loss_sum, fpt = ours(config, ac, device)
                row = measure(f"ours ({ac})", model, loss_sum, fpt, batch, micro, seq_len,
                              config.model.vocab_size, args, device)
                results.append({"config": path, **row})
                print(json.dumps(results[-1]), flush=True)
                write_payload()
                del model, loss_sum
                free_memory(device)
            peer = None if args.no_fla else fla_peer(config, device)
            if peer is not None:
                model, loss_sum = peer
                row = measure("fla-core", model, loss_sum, fpt, batch, args.peer_micro or micro, seq_len,
                              config.model.vocab_size, args, device)
                results.append({"config": path, **row})
                print(json.dumps(results[-1]), flush=True)
                write_payload()
                del model, loss_sum, peer
                free_memory(device)
    payload = write_payload()
    print(f"\n{payload['device']}, torch {torch.__version__}")
    print(f"{'config':24s} {'model':18s} {'batch':>5s} {'micro':>5s} {'ms/step':>9s} {'tok/s':>9s} "
          f"{'MFU':>6s} {'peak GiB':>9s}")
    for r in results:
        if r.get("oom") or r.get("error"):
            print(f"{Path(r['config']).name:24s} {r['model']:18s} {r['batch']:5d} {r['micro']:5d} "
                  + ("      OOM" if r.get("oom") else f"  error: {r['error']}"))
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        step_ms = "-" if r["step_ms"] is None else f"{r['step_ms']:.1f}"
        print(f"{Path(r['config']).name:24s} {r['model']:18s} {r['batch']:5d} {r['micro']:5d} "
              f"{step_ms:>9s} {r['tokens_per_s']:9,.0f} {mfu:>6s} {r['peak_gib']:9.1f}"
              + (f"  GPU idle {r['idle_share']:.1%} profiled, {r['idle_share_steady']:.1%} steady"
                 if r.get("idle_share") is not None else ""))
    for r in results:
        if r.get("buckets_ms"):
            print(f"\n{r['model']} profile, {Path(r['config']).name}: {r['profile_wall_ms']:.1f} ms a step")
            for bucket, ms in sorted(r["buckets_ms"].items(), key=lambda item: -item[1]):
                print(f"  {bucket:20s} {ms:9.2f} ms")
            for kernel in r.get("top_kernels", []):
                print(f"    {kernel['ms_per_step']:8.2f} ms  {kernel['name'][:100]}")
    for path, acc in accounts.items():
        print(f"\nsaved activations, {Path(path).name}, batch {acc['batch']} x {acc['seq_len']}: "
              f"{acc['total_gib']:.2f} GiB")
        for module, mib in list(acc["by_module_mib"].items())[:25]:
            print(f"  {module:40s} {mib:9.1f} MiB")
        print_step_accounts(path, acc.get("steps", []))
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
