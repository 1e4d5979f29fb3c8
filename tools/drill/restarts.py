"""Part 4: `torchrun --max-restarts=2 --nproc_per_node=2 ... --resume auto` (`--max-restarts N` sets
another limit) with one worker SIGKILLed after a checkpoint exists. The job must finish (status 0)
with its final checkpoint, its restart resuming the newest checkpoint at the kill or a later one,
within a bounded time (a job past RESTART_LIMIT_S counts as hung); the rank whose peer was killed
must say so in its one line (exit status 5) with the restart torchrun makes next, not in a
traceback."""
from __future__ import annotations

import os
import random
import signal
import time

from gdn_parallel.checkpoint import complete_checkpoints

from .processes import Running, Workspace, train_argv, worker_pids
from .reading import (
    WORKER_FAILED,
    damage_of,
    final_checkpoint_ok,
    newest_complete,
    resume_report,
    step_of,
    survivors_said,
    tracebacks,
)

RESTART_STEPS, RESTART_INTERVAL, RESTART_LIMIT_S = 120, 10, 240


def restart_trial(workspace: Workspace, index: int, seed: int, max_restarts: int = 2) -> dict:
    rng = random.Random(f"{seed}:restarts:{index}")
    victim_rank, delay_s = index % 2, rng.uniform(0.0, 2.0)
    trial_dir = workspace.directory(f"restart{index}")
    out_dir = trial_dir / "run"
    overrides = ["parallel.tp=2", f"checkpoint.interval={RESTART_INTERVAL}", "train.log_every=20",
                 # a restarted rank that cannot meet its peers fails after this, not torch's 30 minutes
                 "train.collective_timeout_s=20"]
    argv = train_argv(workspace, out_dir, RESTART_STEPS, overrides, procs=2, resume="auto",
                      max_restarts=max_restarts)
    result = {"index": index, "victim_rank": victim_rank, "delay_s": round(delay_s, 3),
              "reproduce": f"python3 tools/fault_drill.py restarts --seed {seed} --trial {index}"}
    running = Running(workspace, argv, trial_dir / "job")
    first = running.wait_for(lambda: bool(complete_checkpoints(str(out_dir))), RESTART_LIMIT_S, poll_s=0.02)
    victim = None
    if first is not None:
        time.sleep(delay_s)
        victim = worker_pids(running.pid).get(victim_rank)
    newest_at_kill = newest_complete(out_dir)
    if victim is None:
        finished = running.finish(RESTART_LIMIT_S)
        result.update(outcome="missed: no checkpoint or no worker to kill", job=finished.record())
        return result
    os.kill(victim, signal.SIGKILL)
    finished = running.finish(RESTART_LIMIT_S)
    report = resume_report(finished)
    final_ok, final_detail = final_checkpoint_ok(out_dir, RESTART_STEPS)
    failures = WORKER_FAILED.findall(finished.stdout + finished.stderr)
    resumed_ok = (report.loaded is not None and newest_at_kill is not None
                  and report.step >= step_of(newest_at_kill) and damage_of(report.loaded) is None)
    recovered = finished.status == 0 and final_ok and resumed_ok
    seen = tracebacks(finished, killed_on_purpose=True)
    # The peer of the killed rank, before the restart: one line that names the restart torchrun makes next.
    survivors = survivors_said(finished, [1 - victim_rank],
                               restart=f"torchrun now restarts every rank (restart 1 of "
                                       f"--max-restarts={max_restarts})")
    result.update(
        outcome="hung" if finished.hung else ("recovered" if recovered else "not recovered"),
        newest_at_kill=str(newest_at_kill), resumed_from=str(report.loaded) if report.loaded else None,
        worker_failures=len(failures), restarts_used=len(failures), final=final_detail,
        raw_tracebacks=[t.record() for t in seen if t.excluded is None],
        excluded_tracebacks=[t.record() for t in seen if t.excluded is not None],
        survivors=survivors, survivor_one_line=all(s["one_line"] for s in survivors.values()),
        lost_restart="Connection refused" in finished.stdout + finished.stderr or len(failures) > 1,
        job=finished.record())
    workspace.discard(trial_dir)
    return result


def run_part(workspace: Workspace, args) -> dict:
    indices = [args.trial] if args.trial is not None else list(range(args.jobs))
    trials = []
    for index in indices:
        trial = restart_trial(workspace, index, args.seed, args.max_restarts)
        trials.append(trial)
        print(f"  restart {index} | killed rank {trial['victim_rank']} | {trial['outcome']} | resumed "
              f"{trial.get('resumed_from')} | worker failures {trial.get('worker_failures')} | "
              f"{trial['job']['wall_s']} s"
              + ("" if trial.get("survivor_one_line", True) else f" | survivor said: {trial['survivors']}")
              + (f" | {len(trial['raw_tracebacks'])} raw traceback(s): "
                 f"{'; '.join(t['who'] + ' ' + t['exception'][:80] for t in trial['raw_tracebacks'])}"
                 if trial.get("raw_tracebacks") else ""), flush=True)
    counted = [t for t in trials if not t["outcome"].startswith("missed")]
    tally = {"jobs": len(counted), "missed": len(trials) - len(counted),
             "recovered": sum(t["outcome"] == "recovered" for t in counted),
             "hung": sum(t["outcome"] == "hung" for t in counted),
             "lost_a_restart": sum(t["lost_restart"] for t in counted),
             "raw_traceback_jobs": sum(bool(t["raw_tracebacks"]) for t in counted),
             "survivor_not_one_line": sum(not t["survivor_one_line"] for t in counted),
             "collective_timeout_s": 20, "max_restarts": args.max_restarts,
             "wall_s": [t["job"]["wall_s"] for t in counted]}
    line = (f"restarts | jobs {tally['jobs']} | recovered {tally['recovered']} | hung {tally['hung']} | "
            f"lost a restart {tally['lost_a_restart']} | raw tracebacks {tally['raw_traceback_jobs']} | "
            f"survivor not in one line {tally['survivor_not_one_line']}")
    return {"tally": tally, "tally_line": line, "trials": trials}


