"""Several nodes over a slow link, simulated on one host (issue 42): which dimension to put across nodes.

    python3 tools/bench_nodes.py                       # 2 nodes x 1 GPU: cp and dp across them
    python3 tools/bench_nodes.py --gpus-per-node 2     # 2 x 2 on 4 GPUs: dp across the nodes, cp within; cp 4
    python3 tools/bench_nodes.py --smoke               # CPU gloo, the tiny config: the plumbing

Each "node" is a torchrun agent of its own (static rendezvous: --nnodes, --node-rank, --master-addr)
holding its own GPUs (CUDA_VISIBLE_DEVICES), as a multi-node launch starts them. Every layout runs
twice: over the machine's own links (NVLink, shared memory), and with NCCL made to treat the agents as
hosts joined by a network and to use its socket transport over the loopback device (`SOCKET_ENV`: no
peer-to-peer, no shared memory, no InfiniBand, a host id per agent). The real trainer runs each at the
per-GPU work of tools/bench_scaling.py's dimension (the same configs and settings); its speed is the
median over logging intervals after --skip, its efficiency tokens/s per GPU over the one-GPU run of
the same dimension in the same call.

Bytes per step: one step is profiled (train.profile_steps) on every rank, and each collective and
point-to-point call the process groups record (torch's `record_param_comms`: group, kind, element
count, dtype) is summed by the group's mesh dimension (dp, cp, dp_cp, tp, pp) and kind. "sent" is
what one rank puts on the wire for it under NCCL's ring algorithms: all-reduce 2(n-1)/n of the
buffer, all-gather (n-1) shards, reduce-scatter (n-1)/n of the input, a send its whole buffer.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_scaling import DIMENSIONS, SMOKE, _environment, _speed, device_name  # noqa: E402

# NCCL over TCP sockets on the loopback device, each agent a host of its own (environment variables of
# NCCL 2.2x, as shipped with torch 2.11): what a cluster without InfiniBand or NVLink between nodes has.
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
              "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0"}
TRANSPORTS = ("local", "socket")
ELEMENT_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2,
                 "Bool": 1, "Byte": 1, "Char": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
PROFILED_STEP = 5


def layouts(nodes: int, gpus_per_node: int, smoke: bool) -> list[tuple[str, str, list[str]]]:
    """(dimension of tools/bench_scaling, name, settings) per layout. The mesh is pp x dp x cp x tp with
    tp innermost, so with one GPU a node any split crosses the nodes; with two a node, dp x cp = 2 x 2
    puts dp across the nodes and cp within them, and cp 4 crosses both."""
    world = nodes * gpus_per_node
    table = SMOKE if smoke else DIMENSIONS
    across = "across the nodes" if gpus_per_node == 1 else "across and within the nodes"
    rows = [("cp", f"cp {world} {across}", table["cp"].settings(world)),
            ("dp", f"dp {world} {across}", table["dp"].settings(world))]
    if gpus_per_node > 1:
        rows.append(("cp", f"dp {nodes} across x cp {gpus_per_node} within",
                     [*table["cp"].settings(gpus_per_node), f"parallel.dp={nodes}"]))
    return rows


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def agent_commands(nodes: int, gpus_per_node: int, config: str, settings: list[str], out_dir: Path,
                   steps: int, log_every: int, port: int) -> list[list[str]]:
    """One torchrun agent per node with a static rendezvous on this host."""
    common = [f"train.steps={steps}", f"train.log_every={log_every}",
              f"train.warmup_steps={min(2, steps - 1)}", f"train.out_dir={out_dir}",
              "checkpoint.enabled=false", "train.eval_every=0", f"train.profile_steps={PROFILED_STEP}"]
    sets = [arg for item in [*settings, *common] for arg in ("--set", item)]
    return [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
             f"--nproc-per-node={gpus_per_node}", "--master-addr=127.0.0.1", f"--master-port={port}",
             "-m", "gdn_parallel.train", "--config", config, *sets] for node in range(nodes)]


def agent_environment(node: int, gpus_per_node: int, transport: str, on_gpu: bool) -> dict:
    env = _environment()
    if on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * gpus_per_node + g) for g in range(gpus_per_node))
    if transport == "socket":
        env.update(SOCKET_ENV)
        env["NCCL_HOSTID"] = f"simulated-node-{node}"   # else NCCL sees one host and may pick its own paths
    return env


def run_agents(commands: list[list[str]], envs: list[dict], logs: list[Path], timeout_s: float):
    """Start every agent, wait for all; on a timeout or a failed agent stop the others. Returns the
    exit statuses (or "timeout")."""
    handles = [open(log, "w") for log in logs]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=h, stderr=subprocess.STDOUT,
                              start_new_session=True)     # a group of its own: stopped with its workers
             for cmd, env, h in zip(commands, envs, handles)]
    deadline = time.monotonic() + timeout_s
    statuses: list = [None] * len(procs)
    try:
        while any(s is None for s in statuses):
            for i, proc in enumerate(procs):
                if statuses[i] is None:
                    statuses[i] = proc.poll()
            failed = any(s not in (None, 0) for s in statuses)
            if failed or time.monotonic() > deadline:
                for i, proc in enumerate(procs):
                    if proc.poll() is None:
                        os.killpg(proc.pid, 15)
                        proc.wait(30)
                        statuses[i] = "timeout" if not failed else "stopped"
                break
            time.sleep(0.5)
    finally:
        for h in handles:
            h.close()
    return statuses


def comm_bytes(profile_dir: Path) -> dict:
    """{rank: {"dim kind": {"calls", "payload_bytes", "sent_bytes"}}} per profiled step, from every
    rank's trace (record_param_comms events)."""
    result = {}
    for trace in sorted(profile_dir.glob("trace_rank*.json")):
        rank = int(trace.stem.removeprefix("trace_rank"))
        steps = _profiled_steps(profile_dir / f"buckets_rank{rank}.json")
        events = json.loads(trace.read_text()).get("traceEvents", [])
        totals: dict = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0})
        for event in events:
            if event.get("name") != "record_param_comms":
                continue
            args = event.get("args", {})
            entry = totals[f"{_dimension(args)} {args.get('Collective name', '?')}"]
            payload, sent = message_bytes(args)
            entry["calls"] += 1
            entry["payload_bytes"] += payload / steps
            entry["sent_bytes"] += sent / steps
        result[rank] = dict(totals)
    return result


def message_bytes(args: dict) -> tuple[int, float]:
    """(the call's buffer in bytes, bytes this rank sends for it under a ring) from its record."""
    size = ELEMENT_BYTES.get(args.get("dtype"), 0)
    n = max(int(args.get("Group size", 1) or 1), 1)
    kind = str(args.get("Collective name", ""))
    inward, outward = int(args.get("In msg nelems", 0)) * size, int(args.get("Out msg nelems", 0)) * size
    if "allreduce" in kind or "all_reduce" in kind:
        return inward, 2 * (n - 1) / n * inward
    if "allgather" in kind or "all_gather" in kind:
        return outward, (n - 1) * inward
    if "reduce_scatter" in kind:
        return inward, (n - 1) / n * inward
    if "alltoall" in kind or "all_to_all" in kind:
        return inward, (n - 1) / n * inward
    if kind in ("send", "isend", "broadcast", "scatter"):
        return inward, float(inward)
    return max(inward, outward), 0.0      # recv, barrier and the like send nothing of their own


def _dimension(args: dict) -> str:
    description = str(args.get("Process Group Description", ""))
    return description.removeprefix("mesh_") or "world"


def _profiled_steps(buckets: Path) -> int:
    try:
        first, last = json.loads(buckets.read_text())["steps"]
        return max(last - first + 1, 1)
    except (OSError, ValueError, KeyError):
        return 1


def measure(dim: str, label: str, settings: list[str], transport: str, nodes: int, gpus_per_node: int,
            args) -> dict:
    table = SMOKE if args.smoke else DIMENSIONS
    name = "_".join([*label.replace(" x ", " ").split(), transport])
    out_dir = args.out / "runs" / name
    commands = agent_commands(nodes, gpus_per_node, table[dim].config, [*settings, *args.extra], out_dir,
                              args.steps, args.log_every, free_port())
    envs = [agent_environment(node, gpus_per_node, transport, not args.smoke) for node in range(nodes)]
    logs = [args.out / f"{name}_node{node}.log" for node in range(nodes)]
    start = time.perf_counter()
    statuses = run_agents(commands, envs, logs, args.timeout_s)
    row = {"dimension": dim, "layout": label, "settings": settings, "transport": transport, "nodes": nodes,
           "gpus_per_node": gpus_per_node, "gpus": nodes * gpus_per_node, "config": table[dim].config,
           "commands": [" ".join(c) for c in commands],
           "status": 0 if all(s == 0 for s in statuses) else statuses,
           "wall_s": round(time.perf_counter() - start, 1), "logs": [log.name for log in logs]}
    row.update(_speed(out_dir / "metrics.jsonl", args.skip))
    row["bytes_per_step"] = comm_bytes(out_dir / "profile")
    return row


def baseline(dim: str, args) -> dict:
    """The one-GPU run of the dimension, under torchrun as the others."""
    table = SMOKE if args.smoke else DIMENSIONS
    return measure(dim, f"{dim} on one GPU", table[dim].settings(1), "local", 1, 1, args)


def summarize(rows: list[dict]) -> str:
    one = {r["dimension"]: r["tokens_per_s"] for r in rows if r["gpus"] == 1 and r.get("tokens_per_s")}
    lines = ["| layout | nodes x GPUs | link | tokens/s | per GPU | efficiency | sent by rank 0 a step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = r.get("tokens_per_s")
        base = one.get(r["dimension"])
        r["efficiency"] = speed / r["gpus"] / base if speed and base else None
        sent = _sent_by_dimension(r.get("bytes_per_step", {}).get(0, {}))
        lines.append(f"| {r['layout']} | {r['nodes']} x {r['gpus_per_node']} | {r['transport']} | "
                     f"{_fmt(speed, ',.0f')} | {_fmt(speed / r['gpus'] if speed else None, ',.0f')} | "
                     f"{_fmt(r['efficiency'], '.3f')} | {sent} |")
    return "\n".join(lines)


def _sent_by_dimension(entries: dict) -> str:
    by_dim: dict = defaultdict(float)
    for key, entry in entries.items():
        by_dim[key.split(" ", 1)[0]] += entry["sent_bytes"]
    sent = [f"{dim} {value / 2 ** 20:,.1f} MiB" for dim, value in sorted(by_dim.items()) if value]
    return ", ".join(sent) or "-"   # gloo records no sizes: "-" on CPU


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help="local (the machine's links), socket (NCCL over TCP, loopback)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=10,
                        help="steps left out (compilation; the profiled step)")
    parser.add_argument("--log-every", type=int, default=None, help="default 10 (1 with --smoke)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/bench_nodes")))
    parser.add_argument("--smoke", action="store_true", help="CPU gloo, the tiny config")
    args = parser.parse_args(argv)
    if args.log_every is None:
        args.log_every = 1 if args.smoke else 10
    unknown = set(args.transports.split(",")) - set(TRANSPORTS)
    if unknown:
        parser.error(f"--transports {','.join(sorted(unknown))}: choose of {', '.join(TRANSPORTS)}")
    if args.nodes < 2:
        parser.error(f"--nodes {args.nodes}: several nodes are the point; give 2 or more")
    if args.skip <= PROFILED_STEP:
        parser.error(f"--skip {args.skip}: the profiled step ({PROFILED_STEP}) must be left out; give more")
    first_measured = -(-args.skip // args.log_every) * args.log_every
    if args.steps <= first_measured:
        parser.error(f"--steps {args.steps} leaves no logging interval after --skip {args.skip}: raise it "
                     f"above {first_measured}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke:
        import torch
        present = torch.cuda.device_count()
        if present < args.nodes * args.gpus_per_node:
            raise SystemExit(f"bench_nodes: {args.nodes} x {args.gpus_per_node} needs that many GPUs, found "
                             f"{present}; --smoke runs the plumbing on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    plan = layouts(args.nodes, args.gpus_per_node, args.smoke)
    rows, start = [], time.monotonic()
    for dim in dict.fromkeys(d for d, _, _ in plan):
        rows.append(baseline(dim, args))
        _say(rows[-1])
    for dim, label, settings in plan:
        for transport in args.transports.split(","):
            if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                print(f"not run ({label}, {transport}): --budget-s {args.budget_s:g} spent")
                continue
            rows.append(measure(dim, label, settings, transport, args.nodes, args.gpus_per_node, args))
            _say(rows[-1])
            _write(rows, args)
    report = _write(rows, args)
    print(report["table"])
    failed = [r for r in rows if r["status"] != 0 or not r.get("tokens_per_s") or not r.get("loss_fell")]
    return 1 if failed else 0


def _say(row: dict) -> None:
    print(f"{row['layout']}, {row['transport']}: status {row['status']} in {row['wall_s']} s, tokens/s "
          f"{row['tokens_per_s']}", flush=True)


def _write(rows: list[dict], args) -> dict:
    report = {"device": device_name(), "smoke": args.smoke, "nodes": args.nodes,
              "gpus_per_node": args.gpus_per_node, "steps": args.steps, "skip": args.skip,
              "log_every": args.log_every, "socket_env": SOCKET_ENV, "settings": args.extra,
              "table": summarize(rows), "rows": rows}
    (args.out / "nodes.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main())
