"""Smoke test of the real job on one GPU: every config in configs/ trains at its own seq_len and batch.

    python tools/gpu_smoke.py [--steps 20] [--configs configs/gdn-1.3b.yaml,...] [--out runs/gpu_smoke]

Each config runs `python -m gdn_parallel.train` in its own process (its own CUDA context and memory
peak) for --steps optimizer steps on the embedded corpus, warmup 2 steps, logging every step. A config
passes when every loss is finite and the mean of the last third of the losses is below the mean of the
first third. Printed per config: seconds from launch to the first step line (start-up: imports, corpus,
model build) and the first step's own time (kernel compilation and autotuning), then the steady
tokens/s, MFU and peak memory over the later steps. A table on stdout and JSON (--out/gpu_smoke.json,
rewritten after every config, so that a run stopped part-way keeps the configs it finished).
Checkpoints are off unless --checkpoint is given: the final save of a 1.3B model with its optimizer
state writes ~16 GB and takes longer than the 20 steps; save and resume have their own checks.
Exit status 1 if any config fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from gdn_parallel.train.metrics_sinks import read_metrics  # noqa: E402  (torn last line of a killed run)


def run_config(config: Path, steps: int, out_dir: Path, extra: list, timeout_s: float,
               checkpoint: bool = False, repo: Path = REPO, env: dict | None = None) -> dict:
    """One config's run, in the source tree `repo` (tools/bench_ab.py runs another commit's tree),
    with `env` added to the environment."""
    run_dir = out_dir / config.stem
    command = [sys.executable, "-m", "gdn_parallel.train", "--config", str(config),
               "--set", f"train.steps={steps}", "--set", "train.warmup_steps=2", "--set", "train.log_every=1",
               "--set", "train.eval_every=0", "--set", f"train.out_dir={run_dir}",
               "--set", f"checkpoint.enabled={str(checkpoint).lower()}", *extra]
    start = time.perf_counter()
    first_step_s, lines = None, []
    # Its own process group, killed whole on a timeout or when this script is stopped: a training
    # process left behind would hold GPU memory and time through whatever runs next.
    proc = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            start_new_session=True)
    deadline = threading.Timer(timeout_s, lambda: _kill_group(proc))
    deadline.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            print(f"  [{config.stem}] {line.rstrip()}", flush=True)
            if first_step_s is None and line.startswith("step 0/"):
                first_step_s = time.perf_counter() - start
        proc.wait()
    finally:
        deadline.cancel()
        _kill_group(proc)
    if time.perf_counter() - start >= timeout_s:
        lines.append(f"killed after {timeout_s:.0f} s")
    records = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        records = read_metrics(metrics)
    steps_done = [r for r in records if "loss" in r and "step" in r]
    losses = [r["loss"] for r in steps_done]
    # At train.log_every > 1 a record stands for several steps: the run is whole when its last step is logged.
    completed = steps_done[-1]["step"] + 1 if steps_done else 0
    later = steps_done[2:] or steps_done  # step 0 compiles; step 1 may still tune
    result = {
        "config": config.name, "returncode": proc.returncode, "steps": completed,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "launch_to_first_step_s": first_step_s,
        "first_step_s": steps_done[0]["interval_s"] if steps_done else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later) if later else None,
        "mfu": statistics.median(r["mfu"] for r in later) if later and later[0]["mfu"] is not None else None,
        "peak_mem_gib": max(r["mem_mib"] for r in steps_done) / 1024 if steps_done else None,
        "wall_s": time.perf_counter() - start,
    }
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    third = max(1, len(losses) // 3)
    falling = len(losses) >= 2 and sum(losses[-third:]) < sum(losses[:third])
    result["passed"] = proc.returncode == 0 and completed == steps and finite and falling
    if not result["passed"]:
        result["why"] = (f"exit status {proc.returncode}" if proc.returncode else
                         "non-finite loss" if not finite else "loss not falling" if not falling else
                         f"{completed} of {steps} steps")
        result["log_tail"] = lines[-15:]
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def table(results: list) -> str:
    head = (f"{'config':18s} {'pass':5s} {'loss first->last':18s} {'start s':>8s} {'step0 s':>8s} "
            f"{'tok/s':>9s} {'MFU':>6s} {'peak GiB':>9s}")
    rows = [head, "-" * len(head)]

    def num(value, fmt):
        return format(value, fmt) if value is not None else "n/a"

    for r in results:
        if r["passed"] is None:
            rows.append(f"{r['config']:18s} {'skip':5s} {r['why']}")
            continue
        losses = f"{num(r['first_loss'], '.3f')} -> {num(r['last_loss'], '.3f')}"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        rows.append(f"{r['config']:18s} {'yes' if r['passed'] else 'NO':5s} {losses:18s} "
                    f"{num(r['launch_to_first_step_s'], '8.1f')} {num(r['first_step_s'], '8.1f')} "
                    f"{num(r['tokens_per_s'], '9,.0f')} {mfu:>6s} {num(r['peak_mem_gib'], '9.1f')}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="",
                   help="comma-separated config files (default: every configs/*.yaml)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra override for every config (repeatable)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per config before it is killed")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "runs"), "gpu_smoke"))
    p.add_argument("--checkpoint", action="store_true", help="keep the final checkpoint save of every run")
    args = p.parse_args(argv)
    # `timeout` and schedulers stop a job with SIGTERM: leave through the finally blocks, which kill
    # the training process of the config that was running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    configs = ([Path(c) for c in args.configs.split(",") if c] if args.configs
               else sorted((REPO / "configs").glob("*.yaml")))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = [x for o in args.overrides for x in ("--set", o)]
    results = []
    import torch

    from gdn_parallel.config import Config
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    def write_report() -> None:
        report = {"device": device, "steps": args.steps, "results": results}
        (out_dir / "gpu_smoke.json").write_text(json.dumps(report, indent=1))

    for config in configs:
        path = config if config.is_absolute() else REPO / config
        world = Config.from_yaml(path, args.overrides, validate=False).parallel.world_size
        if world > 1:  # a multi-GPU layout (the long-context configs): not a one-GPU smoke test
            print(f"  [{path.stem}] skipped: its layout needs {world} processes", flush=True)
            results.append({"config": path.name, "passed": None, "why": f"needs {world} GPUs"})
            continue
        results.append(run_config(path, args.steps, out_dir, extra, args.timeout, args.checkpoint))
        write_report()
        print(table(results[-1:]), flush=True)
    write_report()
    print(f"\n{device}, {args.steps} steps per config, {out_dir / 'gpu_smoke.json'}")
    print(table(results))
    return 0 if all(r["passed"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
