"""Part 1: SIGKILL while a checkpoint is being written. One-process runs of the tiny config (and some
under torchrun, tp=2 or dp=2: the whole job, or one worker) are killed a random delay after
`step_N.partial` appears; then `--resume auto` must go on from the newest complete checkpoint that
verifies to the end. Where one worker was killed, the other must end in the one line of a rank whose
peer died (exit status 5), not a traceback."""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gdn_parallel.checkpoint import complete_checkpoints

from .processes import RUN_LIMIT_S, Running, Workspace, kill_session, run, shell_line, train_argv, worker_pids
from .reading import (
    damage_of,
    final_checkpoint_ok,
    newest_complete,
    raw_tracebacks,
    resume_report,
    step_of,
    summary_of,
    survivors_said,
)

KILL_STEPS = 8


@dataclass
class KillPlan:
    index: int
    procs: int
    layout: str | None       # "tp" / "dp" under torchrun
    kill: str                   # process | job (torchrun and every worker) | worker (one rank)
    victim_rank: int
    interval: int
    keep: int
    async_save: bool
    target_step: int
    delay_fraction: float       # of the save's measured duration

    def overrides(self) -> list[str]:
        layout = [f"parallel.{self.layout}=2"] if self.layout else []
        return [*layout, f"checkpoint.interval={self.interval}", f"checkpoint.keep={self.keep}",
                f"checkpoint.async_save={str(self.async_save).lower()}"]

    def reference_key(self) -> tuple:
        return (self.procs, self.layout, self.async_save)


def plan_kill(index: int, seed: int, procs: int) -> KillPlan:
    rng = random.Random(f"{seed}:kill:{index}")
    interval = rng.choice([1, 2])
    saves = sorted({step for step in range(1, KILL_STEPS + 1) if step % interval == 0} | {KILL_STEPS})
    if procs == 1:
        layout, kill = None, "process"
    else:   # cover tp/dp x job/worker within four trials
        layout, kill = ("tp", "dp")[(index // 2) % 2], ("job", "worker")[index % 2]
    return KillPlan(index=index, procs=procs, layout=layout, kill=kill, victim_rank=rng.choice([0, 1]),
                    interval=interval, keep=rng.choice([0, 0, 2]), async_save=rng.random() < 0.3,
                    target_step=rng.choice(saves), delay_fraction=rng.random())


class SaveWatcher(threading.Thread):
    """Watches a run's checkpoints/ every millisecond: when each `step_N.partial` appeared and when
    `step_N` did (the save's duration as a user's disk sees it)."""

    def __init__(self, out_dir: Path):
        super().__init__(daemon=True)
        self.root = out_dir / "checkpoints"
        self.partial_seen: dict[int, float] = {}
        self.published_seen: dict[int, float] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                names = os.listdir(self.root)
            except OSError:
                names = []
            now = time.monotonic()
            for name in names:
                match = re.match(r"^step_(\d+)(\.partial)?$", name)
                if match:
                    seen = self.partial_seen if match.group(2) else self.published_seen
                    seen.setdefault(int(match.group(1)), now)
            time.sleep(0.001)

    def durations(self) -> list[float]:
        return [self.published_seen[s] - t for s, t in self.partial_seen.items() if s in self.published_seen]


def reference_run(workspace: Workspace, key: tuple, cache: dict[tuple, dict]) -> dict:
    """An uninterrupted run of a layout (checkpoint every step): its save durations and its summary."""
    if key in cache:
        return cache[key]
    procs, layout, async_save = key
    out_dir = workspace.directory("reference")
    overrides = [*([f"parallel.{layout}=2"] if layout else []), "checkpoint.interval=1",
                 f"checkpoint.async_save={str(async_save).lower()}"]
    argv = train_argv(workspace, out_dir / "run", KILL_STEPS, overrides, procs=procs)
    watcher = SaveWatcher(out_dir / "run")
    watcher.start()
    finished = run(workspace, argv, out_dir / "reference")
    watcher.stopped.set()
    watcher.join()
    if finished.status != 0:
        raise RuntimeError(f"the reference run failed (status {finished.status}): {shell_line(argv)}\n"
                           f"{finished.stderr[-3000:]}")
    durations = watcher.durations()
    cache[key] = {"command": shell_line(argv), "summary": summary_of(out_dir / "run"),
                  "save_s": sorted(durations), "longest_save_s": max(durations, default=0.2),
                  "wall_s": round(finished.wall_s, 1)}
    shutil.rmtree(out_dir, ignore_errors=True)
    return cache[key]


def _kill(running: Running, plan: KillPlan) -> None:
    if plan.kill == "worker":
        victim = worker_pids(running.pid).get(plan.victim_rank)
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
            return
        plan.kill = "job (worker not found)"   # not started yet or already gone: the whole job instead
    kill_session(running.process)


def kill_trial(workspace: Workspace, plan: KillPlan, reference: dict, reproduce: str) -> dict:
    trial_dir = workspace.directory(f"kill{plan.index}")
    out_dir = trial_dir / "run"
    argv = train_argv(workspace, out_dir, KILL_STEPS, plan.overrides(), procs=plan.procs)
    partial = out_dir / "checkpoints" / f"step_{plan.target_step}.partial"
    delay_s = plan.delay_fraction * reference["longest_save_s"]
    result = {"index": plan.index, "plan": dict(plan.__dict__), "delay_s": round(delay_s, 4),
              "reproduce": reproduce}
    running = Running(workspace, argv, trial_dir / "killed")
    seen_at = running.wait_for(partial.is_dir, RUN_LIMIT_S)
    if seen_at is None:
        result.update(outcome="missed: the run ended before the save began",
                      killed_run=running.finish().record())
        workspace.discard(trial_dir)
        return result
    time.sleep(max(0.0, seen_at + delay_s - time.monotonic()))
    _kill(running, plan)
    killed_after_s = time.monotonic() - seen_at
    killed = running.finish(limit_s=RUN_LIMIT_S)
    # A save was in flight at the kill when its step_N.partial is left (nothing else leaves one behind;
    # with async_save a save stays in flight over the training steps until it is published).
    partials_at_kill = sorted(p.name for p in (out_dir / "checkpoints").glob("*.partial"))
    newest = newest_complete(out_dir)
    if newest is not None and step_of(newest) == KILL_STEPS:   # nothing left to resume
        result.update(outcome="missed: the final checkpoint was complete before the kill",
                      killed_after_s=round(killed_after_s, 4), killed_run=killed.record())
        workspace.discard(trial_dir)
        return result
    verified = {str(path): damage_of(path) for path in complete_checkpoints(str(out_dir))}
    newest_verifying = max((Path(p) for p, problem in verified.items() if problem is None), key=step_of,
                           default=None)
    resumed = run(workspace, argv + ["--resume", "auto"], trial_dir / "resume")
    report = resume_report(resumed)
    final_ok, final_detail = final_checkpoint_ok(out_dir, KILL_STEPS)
    expected_step = step_of(newest_verifying) if newest_verifying else 0
    resumed_step = report.step if report.loaded else (0 if report.afresh else None)
    loaded_damage = verified.get(str(report.loaded)) if report.loaded else None
    passed_over = {str(path) for path, _ in report.passed_over}
    problems = []
    if resumed.status != 0:
        problems.append("resume " + ("hung" if resumed.hung else f"exited {resumed.status}"))
    if resumed_step is None:
        problems.append("no resume line")
    elif resumed_step < expected_step:
        problems.append(f"resumed step {resumed_step}, the newest complete checkpoint that verifies is "
                        f"step {expected_step}")
    if report.loaded and (loaded_damage is not None or str(report.loaded) not in verified):
        problems.append(f"loaded {report.loaded}, which does not verify ({loaded_damage})")
    if not final_ok:
        problems.append(f"final checkpoint: {final_detail}")
    # The rank whose peer was killed: its one line on stderr, nothing else there (its status is reported:
    # 5, or torchrun's SIGTERM after the line, which torchrun sends every worker once one has died).
    survivors = survivors_said(killed, [1 - plan.victim_rank]) if plan.kill == "worker" else {}
    survivors_ok = all(s["one_line"] for s in survivors.values())
    summary = summary_of(out_dir)
    same_as_reference = bool(summary and reference["summary"] and all(
        summary.get(k) == reference["summary"].get(k) for k in ("final_loss", "val_loss")))
    result.update(
        outcome="lost" if problems else "recovered", problems=problems,
        killed_mid_save=bool(partials_at_kill), partials_at_kill=partials_at_kill,
        killed_after_s=round(killed_after_s, 4),
        killed_run_status=killed.status, newest_complete_at_kill=str(newest) if newest else None,
        damaged_complete_checkpoints={p: d for p, d in verified.items() if d},
        resumed_from=str(report.loaded) if report.loaded else ("step 0" if report.afresh else None),
        resumed_step=resumed_step, passed_over=sorted(passed_over),
        silent_corrupt_resume=bool(report.loaded and loaded_damage and str(report.loaded) not in passed_over),
        same_as_uninterrupted=same_as_reference, survivors=survivors, survivors_ok=survivors_ok,
        partial_left=sorted(p.name for p in (out_dir / "checkpoints").glob("*.partial")),
        raw_tracebacks=raw_tracebacks(killed, killed_on_purpose=True) + raw_tracebacks(resumed),
        killed_run=killed.record(), resume=resumed.record())
    workspace.discard(trial_dir)
    return result


def _say(plan: KillPlan, trial: dict) -> None:
    print(f"  kill {plan.index:2d} | {plan.procs} proc {plan.layout or ''} {plan.kill:7s} | save "
          f"step_{plan.target_step} +{trial['delay_s'] * 1000:.0f} ms | {trial['outcome']}"
          + (f" from {trial.get('resumed_from')}" if trial.get("resumed_from") else "")
          + (f" | {'; '.join(trial['problems'])}" if trial.get("problems") else "")
          + (" | survivor: "
             + "; ".join(f"{who} status {s['status']}, {'one line' if s['one_line'] else s['stderr']}"
                         for who, s in trial["survivors"].items())
             if trial.get("survivors") else "")
          + (f" | {len(trial['raw_tracebacks'])} raw traceback(s)" if trial.get("raw_tracebacks") else ""),
          flush=True)


def run_part(workspace: Workspace, args) -> dict:
    plans = [plan_kill(i, args.seed, 1) for i in range(args.runs)]
    plans += [plan_kill(args.runs + j, args.seed, 2) for j in range(args.runs_2proc)]
    if args.trial is not None:
        plans = [p for p in plans if p.index == args.trial]
    references: dict[tuple, dict] = {}
    trials = []
    for plan in plans:
        reference = reference_run(workspace, plan.reference_key(), references)
        reproduce = (f"python3 tools/fault_drill.py kill-during-save --seed {args.seed} --runs {args.runs} "
                     f"--runs-2proc {args.runs_2proc} --trial {plan.index}")
        for attempt in range(1, 4):   # a kill that came after the run's end is tried again, sooner
            trial = kill_trial(workspace, plan, reference, reproduce)
            trial["attempt"] = attempt
            if not trial["outcome"].startswith("missed"):
                break
            plan.delay_fraction /= 4
        trials.append(trial)
        _say(plan, trial)
    counted = [t for t in trials if not t["outcome"].startswith("missed")]
    with_survivor = [t for t in counted if t["survivors"]]
    tally = {
        "runs": len(counted), "missed": len(trials) - len(counted),
        "runs_1proc": sum(t["plan"]["procs"] == 1 for t in counted),
        "runs_2proc": sum(t["plan"]["procs"] == 2 for t in counted),
        "killed_mid_save": sum(t["killed_mid_save"] for t in counted),
        "lost": sum(t["outcome"] == "lost" for t in counted),
        "raw_traceback_runs": sum(bool(t["raw_tracebacks"]) for t in counted),
        "silent_corrupt_resumes": sum(t["silent_corrupt_resume"] for t in counted),
        "not_same_as_uninterrupted": sum(not t["same_as_uninterrupted"] for t in counted),
        "partial_dirs_left": sum(bool(t["partial_left"]) for t in counted),
        "worker_kills": len(with_survivor),
        "survivor_not_one_line": sum(not t["survivors_ok"] for t in with_survivor),
        "survivor_statuses": sorted(str(s["status"]) for t in with_survivor for s in t["survivors"].values()),
    }
    line = (f"kill-during-save | runs {tally['runs']} ({tally['runs_1proc']} x 1 process, "
            f"{tally['runs_2proc']} x 2) | killed mid-save {tally['killed_mid_save']} | lost {tally['lost']} "
            f"| raw tracebacks {tally['raw_traceback_runs']} | silent corrupt resumes "
            f"{tally['silent_corrupt_resumes']} | differ from uninterrupted "
            f"{tally['not_same_as_uninterrupted']} | survivor of a killed worker not in "
            f"one line {tally['survivor_not_one_line']}/{tally['worker_kills']} (statuses "
            f"{', '.join(tally['survivor_statuses']) or '-'}) | missed {tally['missed']}")
    return {"tally": tally, "tally_line": line, "references": {str(k): v for k, v in references.items()},
            "trials": trials}
