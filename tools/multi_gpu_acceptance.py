"""The multi-GPU acceptance run: the distributed job as users launch it, on NCCL (issue 41).

    python3 tools/multi_gpu_acceptance.py verify long drill --gpus 0,1 --out $OUT     # 2 GPUs
    python3 tools/multi_gpu_acceptance.py verify long --gpus 0,1,2,3 --out $OUT        # 4 GPUs
    python3 tools/multi_gpu_acceptance.py --table docs/multi_gpu/leg_*.json             # the markdown table
    python3 tools/multi_gpu_acceptance.py long verify --smoke --out runs/multi_smoke   # CPU gloo, tiny

Legs (each its own processes, on the GPUs of --gpus, a time limit each; JSON per leg in --out):
  verify  gdn-verify --checkpoint --dtype bf16 at a paper-scale hybrid (configs/h1-0.4b.yaml, one row
          of 8K tokens per micro-batch) over every default layout of that many GPUs;
  long    the long-context config of that many GPUs (2: configs/h1-1.3b-256k.yaml, cp 2; 4:
          configs/h1-1.3b-1m.yaml, cp 4) on documents of many lengths (tools/prepare_data.py over this
          Python's standard library, bytes), --steps steps logged one by one with an asynchronous
          checkpoint after step --save-after, then resumed from that checkpoint in a new run: the
          resumed losses must equal the first run's bit for bit. The step-time table (median, worst
          step after the second, the step after the save, what each slow step compiled on any
          rank), the start-up and the end of the run (final evaluation + save) come from
          metrics.jsonl and the output;
  data    only the documents of `long` (before legs that run side by side);
  drill   tools/fault_drill.py restarts: torchrun --max-restarts=1, one of 2 ranks SIGKILLed after a
          checkpoint exists, the job must finish from its newest checkpoint (2 jobs; first 2 GPUs).
Each leg writes leg_<name>.json (what ran, its status and the verdict) beside its logs and reports.
Exit status 1 when a leg fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from gdn_parallel.train.metrics_sinks import read_metrics  # noqa: E402
from tools.process_tree import kill_session, stop_job  # noqa: E402

LONG_CONFIGS = {2: "configs/h1-1.3b-256k.yaml", 4: "configs/h1-1.3b-1m.yaml"}
STEADY_BOUND = 0.15      # every step after the second within 15% of the median (issue 41)


_RUNNING: list[subprocess.Popen] = []   # the child in flight, killed whole when this script is stopped


def _stop_children(signum, _frame) -> None:
    for proc in _RUNNING:
        kill_session(proc)   # torchrun and its workers (sessions of their own): they would hold the GPUs
    sys.exit(128 + signum)


END_GRACE_S = 60.0   # from the trainer's `done` line to its processes' exit, before they count as hung
DONE_LINE = b"done  |"


def run(command: list[str], log: Path, gpus: str | None, limit_s: float, env: dict | None = None) -> dict:
    """Run `command` with its output in `log`. Stopped whole, its ranks' stacks printed first
    (process_tree.stop_job), after `limit_s`, or END_GRACE_S after it said `done` and still had not
    ended: status "timeout" or "hung after done"."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if gpus is not None:
        environ["CUDA_VISIBLE_DEVICES"] = gpus
    start = time.perf_counter()
    done_at = None
    with open(log, "w") as out, open(log, "rb") as follow:
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                start_new_session=True)
        _RUNNING.append(proc)
        seen = b""   # the log's last bytes read: a `done` line cut between two reads is still found
        try:
            while (status := proc.poll()) is None:
                now = time.perf_counter()
                if done_at is None:
                    seen = seen[-len(DONE_LINE):] + follow.read()
                    if DONE_LINE in seen:
                        done_at = now
                if now - start > limit_s or (done_at is not None and now - done_at > END_GRACE_S):
                    status = "timeout" if done_at is None else "hung after done"
                    stop_job(proc)
                    break
                time.sleep(1.0)
        finally:
            _RUNNING.remove(proc)
    return {"command": " ".join(command), "status": status, "wall_s": round(time.perf_counter() - start, 1),
            "log": log.name}


def torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]


# ---------------------------------------------------------------- verify
VERIFY_CONFIG, VERIFY_TOKENS = "configs/h1-0.4b.yaml", 8192


def verify_layouts(n: int, part: str | None) -> list[str]:
    """The default layouts of n GPUs at the verify leg's model and row, or part K of N ("K/N"): N
    contiguous shares of them, for a device call too short for all (4 GPUs: ~10 minutes together)."""
    if part is None:
        return []
    from gdn_parallel.config import Config
    from gdn_parallel.verify.layouts import default_layouts

    k, parts = (int(x) for x in part.split("/"))
    model = Config.from_yaml(VERIFY_CONFIG).model
    names = [lay.name for lay, reason in default_layouts(n, model, VERIFY_TOKENS) if reason is None]
    share = -(-len(names) // parts)
    return names[(k - 1) * share:k * share]


def leg_verify(args, n: int, out: Path) -> dict:
    suffix = "" if args.verify_part is None else "_part" + args.verify_part.replace("/", "of")
    json_path = out / f"verify_{n}gpu{suffix}.json"
    if args.smoke:
        flags = ["--config", "configs/tiny-cpu.yaml", "--layouts", "dp2,ddp", "cp2", "--checkpoint"]
    else:
        chosen = verify_layouts(n, args.verify_part)
        flags = ["--config", VERIFY_CONFIG, "--dtype", "bf16", "--seq-len", str(VERIFY_TOKENS), "--rows", "1",
                 "--checkpoint", *(["--layouts", *chosen] if chosen else [])]
    result = run(torchrun(n, "-m", "gdn_parallel.verify", *flags, "--json", str(json_path)),
                 out / f"verify_{n}gpu{suffix}.log", args.gpus, args.limit_s)
    report = json.loads(json_path.read_text()) if json_path.is_file() else {}
    layouts = [{"name": lay["name"], "status": lay["status"], "seconds": round(lay.get("seconds", 0.0), 1),
                "errors": lay.get("errors"), "resume_same": lay.get("resume_same")}
               for lay in report.get("layouts", [])]
    result.update(device=report.get("device"), passed=result["status"] == 0 and bool(report.get("passed")),
                  finished=bool(report.get("finished")), layouts=layouts, json=json_path.name,
                  part=args.verify_part)
    return result


# ---------------------------------------------------------------- long context
def documents(out: Path, args) -> Path:
    """Documents of many lengths: this Python's standard library, one document per file, as bytes."""
    target = Path(args.work) / "stdlib_docs"
    if not (target / "gdn_tokens.json").is_file():   # written last by prepare_data
        run([sys.executable, "tools/prepare_data.py", sysconfig.get_paths()["stdlib"], "--tokenizer", "bytes",
             "--out", str(target), "--workers", "8", "--force", "--progress", "lines"],
            out / "prepare_data.log", None, 300)
    return target


def train_command(n: int, config: str, out_dir: Path, args, data: Path, extra: list[str]) -> list[str]:
    settings = [f"train.steps={args.steps}", "train.log_every=1", "train.warmup_steps=2",
                f"checkpoint.interval={args.save_after + 1}", "checkpoint.async_save=true",
                f"train.out_dir={out_dir}", f"data.source={data}", *args.set]
    if args.smoke:
        settings += [f"parallel.cp={n}", "train.batch_size=1", "train.seq_len=1024", "model.n_layers=4"]
    return torchrun(n, "-m", "gdn_parallel.train", "--config", config,
                    *[a for s in settings for a in ("--set", s)], *extra)


def step_table(records: list[dict], save_after: int) -> dict:
    """Per-step times (log_every 1) and the summary the issue asks for."""
    steps = [r for r in records if "interval_s" in r and r.get("interval_steps") == 1]
    times = {r["step"]: r["interval_s"] for r in steps}
    steady = {s: t for s, t in times.items() if s >= 2}
    median = statistics.median(steady.values()) if steady else None
    worst_step = max(steady, key=steady.get) if steady else None
    after_save = save_after + 1
    return {
        "step_s": {str(s): round(t, 3) for s, t in sorted(times.items())},
        "median_s": median,
        "worst_step": worst_step,
        "worst_over_median": None if median is None else round(steady[worst_step] / median, 3),
        "after_save_step": after_save,
        "after_save_over_median": (round(times[after_save] / median, 3)
                                   if median is not None and after_save in times else None),
        "compiled": {str(r["step"]): r["compiled"] for r in steps if r.get("compiled")},
        "saving": [r["step"] for r in steps if r.get("saving")],
        "tokens_per_s_median": (None if median is None else round(_tokens_per_step(steps[0]) / median)),
    }


def other_ranks_compiled(log: Path) -> list[str]:
    """The compilations of ranks other than 0 after start-up, as they printed them (`note  | rank R,
    step S: ...`): the metrics hold rank 0's alone, and any rank's slows every rank's step."""
    if not log.is_file():
        return []
    return [line.strip() for line in log.read_text(errors="replace").splitlines()
            if re.match(r"\s*note +\| rank \d+, step \d+:", line)]


def _tokens_per_step(record: dict) -> float:
    return record["tokens_per_s"] * record["interval_s"]


def document_layout(config: str, data: Path, steps: int, ranks: int) -> dict:
    """Per step, each context-parallel rank's share of the sequence: [documents or pieces of them, the
    longest, the first, the last, in tokens]. A document that runs across ranks is walked rank after
    rank by the state relay: its pieces (a rank's last, the next rank's first) are on the critical path."""
    from gdn_parallel.config import Config
    from gdn_parallel.data.stream import TokenBatches
    cfg = Config.from_yaml(REPO / config, [f"data.source={data}"])
    stream = TokenBatches.from_config(cfg.data, cfg.train.seq_len, 1)
    share = cfg.train.seq_len // ranks
    layout = {}
    for step in range(steps):
        per_rank = []
        for rank in range(ranks):
            start = step * cfg.train.seq_len + rank * share
            pieces = stream._order.span(start, start + share)
            lengths = pieces.ends - pieces.begins
            per_rank.append([int(lengths.size), int(lengths.max()), int(lengths[0]), int(lengths[-1])])
        layout[str(step)] = per_rank
    return layout


def leg_long(args, n: int, out: Path) -> dict:
    config = "configs/tiny-cpu.yaml" if args.smoke else LONG_CONFIGS[n]
    data = documents(out, args)
    first_dir, resumed_dir = Path(args.work) / f"long_{n}", Path(args.work) / f"long_{n}_resumed"
    for stale in (first_dir, resumed_dir):   # an earlier acceptance run's
        shutil.rmtree(stale, ignore_errors=True)
    first = run(train_command(n, config, first_dir, args, data, []), out / f"long_{n}gpu.log", args.gpus,
                args.limit_s)
    checkpoint = first_dir / "checkpoints" / f"step_{args.save_after + 1}"
    resumed = run(train_command(n, config, resumed_dir, args, data, ["--resume", str(checkpoint)]),
                  out / f"long_{n}gpu_resumed.log", args.gpus, args.limit_s)
    records = read_metrics(first_dir / "metrics.jsonl") if (first_dir / "metrics.jsonl").is_file() else []
    again = read_metrics(resumed_dir / "metrics.jsonl") if (resumed_dir / "metrics.jsonl").is_file() else []
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    losses_again = {r["step"]: r["loss"] for r in again if "loss" in r}
    compared = sorted(set(losses_again) & {s for s in losses if s > args.save_after})
    table = step_table(records, args.save_after)
    table["compiled_other_ranks"] = other_ranks_compiled(out / f"long_{n}gpu.log")
    startup = next((r["startup"] for r in records if "startup" in r), None)
    last = max((r for r in records if "interval_s" in r), key=lambda r: r["step"], default=None)
    summary = next((r for r in reversed(records) if "tokens_per_s" in r and "final_loss" in r), None)
    end_s = None
    if last is not None and first["status"] == 0:
        end_s = round(first["wall_s"] - (startup or {}).get("setup_s", 0.0) - last["elapsed_s"], 1)
    steady_ok = (table["worst_over_median"] is not None and table["worst_over_median"] <= 1 + STEADY_BOUND
                 and (table["after_save_over_median"] or 0) <= 1 + STEADY_BOUND)
    bitwise = bool(compared) and all(losses[s] == losses_again[s] for s in compared)
    return {"config": config, "gpus": n, "steps": args.steps, "save_after_step": args.save_after,
            "set": args.set, "first": first, "resumed": resumed, "startup": startup, "end_of_run_s": end_s,
            "summary": summary, "steps_table": table, "steady_within_bound": steady_ok,
            "documents_per_rank": None if args.smoke else document_layout(config, data, args.steps, n),
            "losses": {str(s): losses[s] for s in sorted(losses)},
            "resumed_losses": {str(s): losses_again[s] for s in sorted(losses_again)},
            "resumed_steps_compared": compared, "resume_bitwise": bitwise,
            "passed": first["status"] == 0 and resumed["status"] == 0 and bitwise}


# ---------------------------------------------------------------- drill
def leg_drill(args, n: int, out: Path) -> dict:
    gpus = ",".join(args.gpus.split(",")[:2]) if args.gpus else None
    json_path = out / "drill_restarts.json"
    result = run([sys.executable, "tools/fault_drill.py", "restarts", "--jobs", "2", "--max-restarts", "1",
                  "--out", str(json_path)], out / "drill_restarts.log", gpus, args.limit_s)
    report = json.loads(json_path.read_text()) if json_path.is_file() else {}
    tally = report.get("parts", {}).get("restarts", {}).get("tally", {})
    result.update(tally=tally, passed=result["status"] == 0 and tally.get("jobs", 0) >= 2
                  and tally.get("recovered") == tally.get("jobs"))
    return result


def leg_data(args, n: int, out: Path) -> dict:
    """The documents alone, made before legs that run side by side share them."""
    target = documents(out, args)
    return {"passed": (target / "gdn_tokens.json").is_file(), "data": str(target)}


LEGS = {"data": leg_data, "verify": leg_verify, "long": leg_long, "drill": leg_drill}


# ---------------------------------------------------------------- the table
def table(paths: list[Path]) -> str:
    rows = ["| leg | GPUs | device | result | detail |", "|---|---|---|---|---|"]
    for path in paths:
        r = json.loads(path.read_text())
        verdict = "pass" if r["passed"] else "FAIL"
        if r["leg"] == "verify":
            fails = [lay["name"] for lay in r["layouts"] if lay["status"] not in ("pass", "skipped")]
            detail = (f"{sum(lay['status'] == 'pass' for lay in r['layouts'])} layouts pass"
                      + (f"; failed: {', '.join(fails)}" if fails else ""))
            part = f" (part {r['part']} of the default set)" if r.get("part") else ""
            rows.append(f"| gdn-verify --checkpoint bf16, h1-0.4b, 8K tokens{part} | {r['gpus']} | "
                        f"{r['device']} | {verdict} | {detail} |")
        elif r["leg"] == "long":
            t = r["steps_table"]
            rows.append(f"| {r['config']}: {r['steps']} steps, async save after step {r['save_after_step']}, "
                        f"resumed | {r['gpus']} | {r['device']} | {verdict} | median {t['median_s']:.2f} s, "
                        f"worst x{t['worst_over_median']} (step {t['worst_step']}), after the save "
                        f"x{t['after_save_over_median']} (every step within {STEADY_BOUND:.0%}: "
                        f"{'yes' if r['steady_within_bound'] else 'no'}); resumed bit for bit: "
                        f"{r['resume_bitwise']} |")
        else:
            t = r["tally"]
            rows.append(f"| restart drill: torchrun --max-restarts=1, a rank SIGKILLed | 2 | {r['device']} | "
                        f"{verdict} | recovered {t.get('recovered')} of {t.get('jobs')} |")
    return "\n".join(rows)


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("legs", nargs="*", metavar="LEG", help=f"legs to run, of {', '.join(LEGS)}")
    parser.add_argument("--table", nargs="+", type=Path, metavar="LEG_JSON",
                        help="print the markdown table of these leg_*.json files and exit")
    parser.add_argument("--gpus", default=None, help="CUDA devices to use, e.g. 0,1 (default: all)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/multi_gpu")))
    parser.add_argument("--work", default="runs/multi_gpu_work", help="checkpoints and data")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-after", type=int, default=5, help="the asynchronous save follows this step")
    parser.add_argument("--limit-s", type=float, default=420.0,
                        help="seconds a process may run (then killed)")
    parser.add_argument("--verify-part", metavar="K/N",
                        help="verify: only part K of N of the default layouts")
    parser.add_argument("--smoke", action="store_true", help="CPU gloo, the tiny config: the legs' plumbing")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="long: a setting for both of its runs, e.g. parallel.cp_algorithm=allgather "
                             "(repeatable; recorded in the leg's JSON)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    unknown = [leg for leg in args.legs if leg not in LEGS]
    if not args.legs or unknown:
        parser.error(f"name the legs to run, of {', '.join(LEGS)} (got {args.legs}), or --table")
    if args.smoke:
        n = 2
    else:
        import torch
        n = len(args.gpus.split(",")) if args.gpus else torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_children)
    failed = False
    for leg in args.legs:
        result = {"leg": leg, "gpus": 2 if leg == "drill" else n, "device": device_name(),
                  **LEGS[leg](args, n, args.out)}
        if leg != "data":
            name = f"leg_{leg}" if leg == "drill" else f"leg_{leg}_{n}gpu"
            if leg == "verify" and args.verify_part:
                name += "_part" + args.verify_part.replace("/", "of")
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
        failed |= not result["passed"]
        print(f"== {leg} ({result['gpus']} GPUs): {'pass' if result['passed'] else 'FAIL'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
