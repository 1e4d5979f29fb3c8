"""Fault drill: does any training run get lost? Real processes of the trainer, killed, corrupted,
starved of disk and restarted, each followed by the `--resume` a user would type (issue 24).

    python3 tools/fault_drill.py all --out drill.json          # every part, restarts last
    python3 tools/fault_drill.py kill-during-save --runs 20 --runs-2proc 6 --out kill.json
    python3 tools/fault_drill.py corrupt --trials 10 --out corrupt.json
    python3 tools/fault_drill.py disk-full --out disk.json      # root: mounts a tmpfs
    python3 tools/fault_drill.py restarts --jobs 5 --out restarts.json
    python3 tools/fault_drill.py other-run --trials 3 --out other.json
    python3 tools/fault_drill.py corrupt --kinds torn-metadata --trial 3   # one case again (same seed)

Parts (docs/reliability.md, "Fault drill", has the measured tally):
  kill-during-save  one-process runs of the tiny config (and some under torchrun, tp=2 or dp=2), SIGKILLed
                    a random delay after `step_N.partial` appears, then `--resume auto` to the end
  corrupt           a finished run's newest checkpoint damaged one way per kind, then `--resume <it>`
                    (must refuse: one line naming the file, status 2) and `--resume auto` (must pass over
                    it loudly and resume the older one; when that one is damaged too, refuse in one line
                    naming the files); planted pickles would create a marker file if they ran; a
                    checkpoint without checksums.json is also resumed with checkpoint.verify=false
  disk-full         a run writing into a small tmpfs until a save fails (status 4, one line), then the
                    tmpfs enlarged and `--resume auto` to the end; always unmounted
  restarts          torchrun --max-restarts=2 --nproc_per_node=2 ... --resume auto with one worker
                    SIGKILLed after a checkpoint exists: does the job finish, or hang?
  other-run         a finished run's step_4 replaced by (or linked to) step_4 of a run with another
                    seed: `--resume <it>` and `--resume auto` must refuse in one line naming both run
                    ids; with checkpoint.allow_other_run=true, and into a fresh out_dir, it resumes

What counts: a run is lost when its resume fails, loads a checkpoint that does not verify, starts
before the newest complete checkpoint, or ends without a final checkpoint that verifies. A run's
output holds a raw traceback when it contains "Traceback (most recent call last)", except torchrun's
agent's own ChildFailedError summary or SignalException when the drill killed a worker (or the job)
on purpose: that summary is how torchrun reports any worker that died, not the trainer's output.
No command may write a checkpoint that is not finite (corrupt, other-run), nor resume another run's
checkpoint without checkpoint.allow_other_run (other-run).
Every trial records its commands; every failing trial its reproduction command. Temporary
directories, mounts and child processes are removed at exit, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tools.drill import corruption, disk_full, kill_during_save, other_run, restarts  # noqa: E402
from tools.drill.damage import CORRUPTIONS  # noqa: E402
from tools.drill.processes import Workspace, raise_on_signal  # noqa: E402

PARTS = ("kill-during-save", "corrupt", "other-run", "disk-full", "restarts")
RUNNERS = {"kill-during-save": kill_during_save.run_part, "corrupt": corruption.run_part,
           "other-run": other_run.run_part, "disk-full": disk_full.run_part, "restarts": restarts.run_part}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    def git(*words: str) -> str:
        done = subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    # The package under test: its commit, and any of its files that differ from it (others' edits).
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "repo": str(REPO), "commit": git("rev-parse", "--short", "HEAD"),
            "package_changes": git("status", "--porcelain", "--", "gdn_parallel", "configs").splitlines()}



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=[*PARTS, "all"], help="which part of the drill ('all': every part, "
                                                              "restarts last)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds every random choice (files, offsets, delays)")
    parser.add_argument("--trial", type=int, help="run only trial number N of the part (reproduces one case)")
    parser.add_argument("--runs", type=int, default=20,
                        help="kill-during-save: one-process runs (default 20)")
    parser.add_argument("--runs-2proc", type=int, default=6,
                        help="kill-during-save: torchrun runs, tp=2 / dp=2 (default 6)")
    parser.add_argument("--trials", type=int, default=10,
                        help="corrupt and other-run: trials per kind (default 10)")
    parser.add_argument("--kinds", nargs="+", choices=list(CORRUPTIONS), metavar="KIND",
                        help=f"corrupt: these kinds only ({', '.join(CORRUPTIONS)})")
    parser.add_argument("--jobs", type=int, default=5, help="restarts: torchrun jobs (default 5)")
    parser.add_argument("--max-restarts", type=int, default=2,
                        help="restarts: torchrun's --max-restarts (default 2; the kill needs 1)")
    parser.add_argument("--data", choices=["small", "stdlib"], default="small",
                        help="'small': the first ~2 MB of stdlib modules as a directory source (default: "
                             "4 s less per start); 'stdlib': the trainer's default corpus")
    parser.add_argument("--keep-temp", action="store_true", help="keep the temporary directory (debugging)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = list(PARTS) if args.part == "all" else [args.part]
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, raise_on_signal)
    workspace = Workspace(args.data, args.keep_temp)
    results = {"machine": machine(), "seed": args.seed, "data": args.data, "parts": {}}
    try:
        for part in parts:
            started, at_start = time.monotonic(), machine()   # others may commit while the drill runs
            print(f"{part}: started {datetime.datetime.now().strftime('%H:%M:%S')}", flush=True)
            found = RUNNERS[part](workspace, args)
            found["wall_s"] = round(time.monotonic() - started, 1)
            found["package_at_start"] = {k: at_start[k] for k in ("date", "commit", "package_changes")}
            results["parts"][part] = found
            print(found["tally_line"] + f" | {found['wall_s']:.0f} s", flush=True)
            if args.out:   # after every part: a later part's failure keeps the earlier results
                args.out.write_text(json.dumps(results, indent=1, default=str))
    finally:
        workspace.close()
    for found in results["parts"].values():
        print(found["tally_line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
