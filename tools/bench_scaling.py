"""Scaling of the trainer over GPUs, dimension by dimension, as users launch it (issue 42).

    python3 tools/bench_scaling.py                     # every GPU of the machine: 1, 2, (4) per dimension
    python3 tools/bench_scaling.py --dims dp,cp --sizes 1,2 --steps 30
    python3 tools/bench_scaling.py --smoke             # CPU gloo, the tiny config: the plumbing

Each row is one run of the real job (`python3 -m gdn_parallel.train` under torchrun, also for one GPU)
at a config of configs/, on the config's data, for `--steps` steps, with its own metrics.jsonl read back.
Its speed is the median of the trainer's own tokens/s over its logging intervals (`--log-every` steps,
10 as in the configs) that start after `--skip` (compilation and the first steps left out). A log line
reads the device: logging every step would make the host wait for the GPU at every step, and a
host-bound run (tensor parallelism's halved kernels) would lose what it gains by running ahead.

Efficiency = tokens/s per GPU at n GPUs / tokens/s of the one-GPU run of the same dimension, all in one
call of this tool (the same machine, the same software). Each dimension keeps each GPU's work as its
issue defines it:
    dp            gdn-1.3b, the config's batch (8, micro-batches of 4) per replica (train.batch_size is per
                  data-parallel replica: the global batch is 8n at dp = n)
    dp-gathered   the same with parallel.fsdp_reshard_after_forward=false (one all-gather a block a step)
    cp            h1-1.3b, full checkpointing, 64K tokens a rank: one row of 64K * n tokens over cp = n
    cp-allgather  the same with parallel.cp_algorithm=allgather
    tp            h1-1.3b, the config's batch over tp = n (the same batch: strong scaling per replica)
    tp-whole-batch the same, with the batch's 8 rows in one micro-batch at tp >= 2: with half of each
                  row's work a GPU, micro-batches of 4 leave the host setting the pace (docs/benchmarks.md,
                  "Host time"); 8 rows halve the launches per token. Its one-GPU baseline is tp's (the
                  config's micro-batches of 4: 8 rows at once need more memory than an H100 has)
A run's loss must fall (first to last logged loss); a failed or non-falling run is said in its row.
Prints the table, writes JSON (`--out`/scaling.json) and a plot (scaling.png, where matplotlib is).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.process_tree import stop_job  # noqa: E402

CP_TOKENS_PER_RANK = 65536


@dataclass(frozen=True)
class Dimension:
    """How one dimension is measured: its config, and the settings of a run at n GPUs."""
    name: str
    config: str
    settings: object    # n -> list of "section.field=value"
    meaning: str
    baseline: str | None = None   # the dimension whose one-GPU run is this one's (run once per call)


def _dp(n: int, batch: int = 8, micro: int = 4) -> list[str]:
    return [f"parallel.dp={n}", f"train.batch_size={batch}", f"train.microbatch_size={micro}"]


def _cp(n: int, tokens: int = CP_TOKENS_PER_RANK, algorithm: str = "relay") -> list[str]:
    return [f"parallel.cp={n}", f"parallel.cp_algorithm={algorithm}", f"train.seq_len={tokens * n}",
            "train.batch_size=1", "train.microbatch_size=1", "train.activation_checkpointing=full"]


def _tp(n: int) -> list[str]:
    return [f"parallel.tp={n}"]


DIMENSIONS = {
    "dp": Dimension("dp", "configs/gdn-1.3b.yaml", _dp, "FSDP2, batch 8 (micro 4) per replica"),
    "dp-gathered": Dimension("dp-gathered", "configs/gdn-1.3b.yaml",
                             lambda n: [*_dp(n), "parallel.fsdp_reshard_after_forward=false"],
                             "as dp, parameters gathered once a step"),
    "cp": Dimension("cp", "configs/h1-1.3b.yaml", _cp, "state relay, 64K tokens a rank, full checkpointing"),
    "cp-allgather": Dimension("cp-allgather", "configs/h1-1.3b.yaml",
                              lambda n: _cp(n, algorithm="allgather"), "summary all-gather, as cp"),
    "tp": Dimension("tp", "configs/h1-1.3b.yaml", _tp, "the config's batch over tp ranks"),
    "tp-whole-batch": Dimension("tp-whole-batch", "configs/h1-1.3b.yaml",
                                lambda n: _tp(n) + (["train.microbatch_size=8"] if n > 1 else []),
                                "as tp, the 8 rows in one micro-batch at tp >= 2", baseline="tp"),
}
# The smoke run: the same dimensions at the tiny config's scale on CPU gloo (2 processes at most).
SMOKE = {
    "dp": Dimension("dp", "configs/tiny-cpu.yaml", lambda n: _dp(n, batch=2, micro=1), "batch 2 a replica"),
    "cp": Dimension("cp", "configs/tiny-cpu.yaml", lambda n: _cp(n, tokens=128), "128 tokens a rank"),
    "tp": Dimension("tp", "configs/tiny-cpu.yaml", lambda n: _tp(n) + ["train.batch_size=2"], "batch 2"),
}


def run_command(n: int, config: str, sets: list[str], out_dir: Path, steps: int,
                log_every: int = 10) -> list[str]:
    """The trainer's command line for one row: under torchrun also for one GPU, so that every row runs
    in the same environment (torchrun sets each worker's CPU threads)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    common = [f"train.steps={steps}", f"train.log_every={log_every}",
              f"train.warmup_steps={min(2, steps - 1)}",
              f"train.out_dir={out_dir}", "checkpoint.enabled=false", "train.eval_every=0"]
    return [*launcher, "-m", "gdn_parallel.train", "--config", config,
            *[arg for item in [*sets, *common] for arg in ("--set", item)]]


def measure_row(dim: Dimension, n: int, args, extra_sets: list[str]) -> dict:
    """One run: its command, status, and the median tokens/s of its steps after --skip."""
    out_dir = args.out / "runs" / f"{dim.name}_{n}"
    command = run_command(n, dim.config, [*dim.settings(n), *extra_sets], out_dir, args.steps, args.log_every)
    log = args.out / f"{dim.name}_{n}.log"
    start = time.perf_counter()
    with open(log, "w") as handle:
        job = subprocess.Popen(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=_environment())
        try:
            status = job.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:   # torchrun's workers too (sessions of their own), or the next row
            stop_job(job)                    # would share the GPUs with them
            status = "timeout"
    row = {"dimension": dim.name, "gpus": n, "config": dim.config, "baseline": dim.baseline,
           "command": " ".join(command),
           "status": status, "wall_s": round(time.perf_counter() - start, 1), "log": log.name}
    row.update(_speed(out_dir / "metrics.jsonl", args.skip))
    return row


def _environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _speed(metrics: Path, skip: int) -> dict:
    """Median tokens/s and MFU of the logging intervals that start at or after step `skip`, and whether
    the loss fell."""
    records = []
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "tokens_per_s" in r]
    steady = [r for r in steps if r["step"] - r.get("interval_steps", 1) + 1 >= skip]
    if not steady:
        return {"tokens_per_s": None, "steps_measured": 0, "loss_fell": None}
    losses = [r["loss"] for r in steps]
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(mfu) if mfu else None,
            "steps_measured": sum(r.get("interval_steps", 1) for r in steady), "intervals": len(steady),
            "first_loss": losses[0], "last_loss": losses[-1], "loss_fell": losses[-1] < losses[0],
            "peak_mem_mib": max((r.get("mem_mib") or 0) for r in steady)}


def efficiencies(rows: list[dict]) -> None:
    """Each row's tokens/s per GPU over its dimension's (or its baseline's) one-GPU tokens/s (in place)."""
    one = {r["dimension"]: r["tokens_per_s"] for r in rows if r["gpus"] == 1 and r["tokens_per_s"]}
    for row in rows:
        base, speed = one.get(row["dimension"]) or one.get(row.get("baseline")), row["tokens_per_s"]
        row["tokens_per_s_per_gpu"] = speed / row["gpus"] if speed else None
        row["efficiency"] = speed / row["gpus"] / base if speed and base else None


def table(rows: list[dict]) -> str:
    lines = ["| dimension | GPUs | tokens/s | per GPU | efficiency | MFU | loss first -> last | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = "-" if r.get("first_loss") is None else (
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}" + ("" if r["loss_fell"] else " (not falling)"))
        lines.append(f"| {r['dimension']} | {r['gpus']} | {_number(r, 'tokens_per_s', ',.0f')} | "
                     f"{_number(r, 'tokens_per_s_per_gpu', ',.0f')} | {_number(r, 'efficiency', '.3f')} | "
                     f"{_number(r, 'mfu', '.3f')} | {loss} | {r['status']} |")
    return "\n".join(lines)


def _number(row: dict, key: str, spec: str) -> str:
    return "-" if row.get(key) is None else format(row[key], spec)


def plot(rows: list[dict], path: Path) -> str | None:
    """Efficiency against GPUs, one line per dimension; the reason when there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    figure, axes = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["dimension"] for r in rows):
        points = [(r["gpus"], r["efficiency"]) for r in rows if r["dimension"] == name and r["efficiency"]]
        if points:
            axes.plot(*zip(*points), marker="o", label=name)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set(xlabel="GPUs", ylabel="tokens/s per GPU / one GPU", title="Scaling of the trainer",
             ylim=(0, 1.1))
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


def device_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dims", default=None,
                        help=f"comma-separated, of {', '.join(DIMENSIONS)} (default: all)")
    parser.add_argument("--sizes", default=None, help="GPU counts, e.g. 1,2,4 (default: 1, 2 and 4 up to "
                                                      "the GPUs present; always with 1, the baseline)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the median (compilation)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="the trainer's logging interval, whose tokens/s are the medians' samples "
                             "(default: 10 as in the configs; 1 with --smoke)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="FIELD=VALUE",
                        help="a setting for every run, e.g. data.source=DIR")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no run after this many seconds (the rest are listed as not run)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/bench_scaling")))
    parser.add_argument("--smoke", action="store_true", help="CPU gloo, the tiny config, 1 and 2 processes")
    args = parser.parse_args(argv)
    if args.log_every is None:
        args.log_every = 1 if args.smoke else 10
    if args.log_every < 1:
        parser.error(f"--log-every {args.log_every}: give a positive number of steps")
    first_measured = -(-args.skip // args.log_every) * args.log_every   # the first interval after --skip
    if args.steps <= first_measured:
        parser.error(f"--steps {args.steps} leaves no logging interval (every {args.log_every} steps) that "
                     f"starts after --skip {args.skip}: raise --steps above {first_measured}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    table_of = SMOKE if args.smoke else DIMENSIONS
    names = args.dims.split(",") if args.dims else list(table_of)
    unknown = [name for name in names if name not in table_of]
    if unknown:
        raise SystemExit(f"bench_scaling: --dims {','.join(unknown)} unknown; "
                         f"choose of {', '.join(table_of)}")
    sizes = _sizes(args)
    if importlib.util.find_spec("gdn_kernels") is None:
        raise SystemExit("bench_scaling: the package's kernels (gdn_kernels) are not importable; install "
                         "the project first: pip install --no-deps --no-build-isolation -e .")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.monotonic()
    for name in names:
        for n in sizes:
            if n == 1 and _baseline_measured(table_of[name], rows):
                continue
            if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                rows.append({"dimension": name, "gpus": n, "config": table_of[name].config,
                             "status": f"not run: --budget-s {args.budget_s:g} spent", "tokens_per_s": None})
            else:
                rows.append(measure_row(table_of[name], n, args, args.extra))
            row = rows[-1]
            print(f"{name} x{n}: status {row['status']} in {row.get('wall_s', 0)} s, "
                  f"tokens/s {row['tokens_per_s']}", flush=True)
            report = write_report(rows, args, table_of, names)   # after every row: a stopped call keeps them
    print(report["table"])
    no_plot = plot(rows, args.out / "scaling.png")
    if no_plot:
        print(no_plot)
    failed = [r for r in rows if r["status"] != 0 or r["tokens_per_s"] is None or not r["loss_fell"]]
    return 1 if failed else 0


def _baseline_measured(dim: Dimension, rows: list[dict]) -> bool:
    """Whether this call already ran the one-GPU row that `dim` shares with its baseline dimension."""
    return dim.baseline is not None and any(r["dimension"] == dim.baseline and r["gpus"] == 1 for r in rows)


def write_report(rows: list[dict], args, table_of: dict, names: list[str]) -> dict:
    """scaling.json with the rows so far, their efficiencies (in place) and the table."""
    efficiencies(rows)
    report = {"device": device_name(), "smoke": args.smoke, "steps": args.steps, "skip": args.skip,
              "log_every": args.log_every,
              "settings": args.extra, "dimensions": {n: table_of[n].meaning for n in names}, "rows": rows,
              "table": table(rows)}
    (args.out / "scaling.json").write_text(json.dumps(report, indent=1))
    return report


def _sizes(args) -> list[int]:
    if args.sizes:
        sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    elif args.smoke:
        sizes = [1, 2]
    else:
        import torch
        present = torch.cuda.device_count()
        if present < 2:
            raise SystemExit("bench_scaling: needs 2 or more GPUs (found "
                             f"{present}); --smoke runs the plumbing on CPU")
        sizes = [n for n in (1, 2, 4) if n <= present]
    return sizes


if __name__ == "__main__":
    sys.exit(main())
