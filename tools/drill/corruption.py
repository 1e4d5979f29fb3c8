"""Part 2: corrupted checkpoints. A finished run's newest checkpoint is damaged one way per kind
(damage.py), then `--resume <it>` must refuse in one line naming the file (status 2), and `--resume
auto` must pass over it loudly, naming the file, and resume the older one to the end; when the older
one is damaged too, it must refuse in one line naming the files. Once per kind the finished run's own
command (train.steps at the damaged checkpoint's step) runs again with `--resume auto`: the damaged
checkpoint must not end the run as if it were finished. A checkpoint whose checksums.json was deleted
is also resumed with `checkpoint.verify=false` (its flipped bytes unseen): the run must finish or stop
in one line, and no command of any trial may write a checkpoint that is not finite."""
from __future__ import annotations

import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from .damage import CORRUPTIONS
from .processes import Finished, Workspace, run, shell_line, train_argv
from .reading import (
    ERROR_PREFIX,
    damage_of,
    final_checkpoint_ok,
    non_finite_checkpoints,
    raw_tracebacks,
    refusal_line,
    refused_in_one_line,
    resume_report,
    stderr_lines,
)

CORRUPT_STEPS, CORRUPT_INTERVAL = 4, 2   # checkpoints step_2 and step_4; resumes go on to RESUME_STEPS
RESUME_STEPS = 6


BASE_RUNS = {"1 process": (1, []), "dp=2": (2, ["parallel.dp=2"]),
             "another seed": (1, ["train.seed=1"])}   # the other run of tools/drill/other_run.py
_made: dict[tuple[Path, str], Path] = {}


def base_runs(workspace: Workspace, names=("1 process", "dp=2")) -> dict[str, Path]:
    """Finished runs with checkpoints step_2 and step_4 (made once per workspace): one process, torchrun
    dp=2 (two data and two RNG files), and one process of another seed; trials copy them."""
    bases = {}
    for name in names:
        if (workspace.root, name) not in _made:
            procs, overrides = BASE_RUNS[name]
            out_dir = workspace.directory("base") / "run"
            argv = train_argv(workspace, out_dir, CORRUPT_STEPS,
                              [*overrides, f"checkpoint.interval={CORRUPT_INTERVAL}"], procs=procs)
            finished = run(workspace, argv, out_dir.parent / "base")
            if finished.status != 0 or damage_of(out_dir / "checkpoints" / "step_4") is not None:
                raise RuntimeError(f"the base run failed (status {finished.status}): {shell_line(argv)}\n"
                                   f"{finished.stderr[-3000:]}")
            _made[workspace.root, name] = out_dir
        bases[name] = _made[workspace.root, name]
    return bases


def judge_auto(finished: Finished, out_dir: Path, none_verify: bool, damaged_names: set, steps: int
               ) -> tuple[str, bool, bool, bool]:
    """(outcome, as expected, silent corrupt resume, lost) of a `--resume auto` after the damage of
    out_dir's step_4 (and step_2 too when none_verify)."""
    damaged, older = out_dir / "checkpoints" / "step_4", out_dir / "checkpoints" / "step_2"
    report = resume_report(finished)
    refusal = refusal_line(finished)
    passed = {str(path): reason for path, reason in report.passed_over}
    silent = report.loaded is not None and str(report.loaded) == str(damaged) and str(damaged) not in passed
    if none_verify and report.loaded is not None and str(report.loaded) == str(older):
        silent = True
    final_ok, _ = final_checkpoint_ok(out_dir, steps)
    # Lost: the user's `--resume auto` neither went on to the end where a checkpoint verifies, nor
    # said in one line why not where none does.
    refused = finished.status == 2 and refusal is not None
    lost = finished.hung or (not refused if none_verify else not (finished.status == 0 and final_ok))
    if finished.hung:
        return "hung", False, silent, lost
    if finished.status == 0 and report.loaded is not None:
        named = any(name in passed.get(str(damaged), "") for name in damaged_names)
        ok = (not none_verify and str(damaged) in passed and named and str(report.loaded) == str(older)
              and final_ok)
        return (f"passed over{'' if named else ' (the file unnamed)'}, resumed {report.loaded.name}",
                ok and not silent, silent, lost)
    if refused:
        # A refusal is expected only when no checkpoint verifies; else step_2 should have been taken.
        said = refusal + " ".join(passed.values())
        names_it = any(name in said for name in damaged_names)
        extra = len(stderr_lines(finished)) - 1
        return (f"refused: {refusal[len(ERROR_PREFIX):][:160]}"
                + (f" (after {extra} more stderr line(s))" if extra else ""),
                none_verify and names_it and not extra, silent, lost)
    return (f"status {finished.status}: {(finished.stderr.strip().splitlines() or [''])[-1][:160]}", False,
            silent, lost)


def unverified_leg(workspace: Workspace, trial_dir: Path, damaged_copy: Callable[[str], tuple[Path, dict]]
                   ) -> tuple[dict, list]:
    """`--resume <it> --set checkpoint.verify=false` of a checkpoint whose checksums.json was deleted
    (the user accepting it unverified): it may load, saying so; then the run must finish, or stop in
    one line (status 2: what was loaded is not finite or cannot be read, naming the checkpoint; 3: a
    step or a save met values that are not finite). (its record, its raw tracebacks)"""
    out_dir, _ = damaged_copy("unverified")
    damaged = out_dir / "checkpoints" / "step_4"
    finished = run(workspace, train_argv(workspace, out_dir, RESUME_STEPS, ["checkpoint.verify=false"],
                                         resume=str(damaged)), trial_dir / "unverified")
    said = any(line.startswith(f"resume | {damaged} has no checksums.json: loaded unverified")
               for line in finished.lines())
    refusal = refusal_line(finished) or ""
    if finished.status == 0:
        ok, outcome = said and final_checkpoint_ok(out_dir, RESUME_STEPS)[0], "loaded unverified, finished"
    elif finished.status in (2, 3):
        ok = refused_in_one_line(finished) and (finished.status == 3 or str(damaged) in refusal)
        outcome = f"stopped (status {finished.status}): {refusal[len(ERROR_PREFIX):][:160]}"
    else:
        ok, outcome = False, f"status {finished.status}"
    return {"outcome": outcome, "as_expected": ok, **finished.record()}, raw_tracebacks(finished)


def corrupt_trial(workspace: Workspace, kind: str, index: int, bases: dict[str, Path], seed: int) -> dict:
    damage, one_process_only = CORRUPTIONS[kind]
    base_name = "1 process" if one_process_only or index % 2 == 0 else "dp=2"
    none_verify = index % 5 == 4          # 2 of 10: the older checkpoint damaged too
    trial_dir = workspace.directory(f"corrupt_{kind}_{index}")
    marker = trial_dir / "code-ran"
    started = time.time()   # the checkpoints sealed after it are the trial's commands' own

    def damaged_copy(name: str) -> tuple[Path, dict]:
        out_dir = trial_dir / name
        shutil.copytree(bases[base_name], out_dir)
        rng = random.Random(f"{seed}:corrupt:{kind}:{index}")   # the same damage in every copy
        done = {"newest": damage(out_dir / "checkpoints" / "step_4", rng, marker)}
        if none_verify:
            done["older"] = damage(out_dir / "checkpoints" / "step_2", rng, marker)
        return out_dir, done

    result = {"kind": kind, "index": index, "base": base_name, "none_verify": none_verify,
              "reproduce": f"python3 tools/fault_drill.py corrupt --seed {seed} --kinds {kind} "
                           f"--trial {index}"}
    out_dir, done = damaged_copy("run")
    result["damage"] = done
    damaged = out_dir / "checkpoints" / "step_4"
    damaged_names = {detail["file"] for detail in done.values()}

    # --resume <the damaged checkpoint>: one line naming the file, status 2.
    explicit = run(workspace, train_argv(workspace, out_dir, RESUME_STEPS, resume=str(damaged)),
                   trial_dir / "explicit")
    refusal = refusal_line(explicit) or ""
    explicit_names_file = str(damaged) in refusal and done["newest"]["file"] in refusal
    explicit_ok = explicit.status == 2 and refused_in_one_line(explicit) and explicit_names_file
    explicit_silent = explicit.status == 0 or resume_report(explicit).loaded is not None

    auto = run(workspace, train_argv(workspace, out_dir, RESUME_STEPS, resume="auto"), trial_dir / "auto")
    auto_outcome, auto_ok, auto_silent, lost = judge_auto(auto, out_dir, none_verify, damaged_names,
                                                          RESUME_STEPS)
    raw = raw_tracebacks(explicit) + raw_tracebacks(auto)

    same_steps: dict | None = None
    if index == 0:   # the finished run's own command: train.steps = the damaged checkpoint's step
        again_dir, _ = damaged_copy("same_steps")
        again = run(workspace, train_argv(workspace, again_dir, CORRUPT_STEPS, resume="auto"),
                    trial_dir / "same")
        outcome, ok, silent, again_lost = judge_auto(again, again_dir, none_verify, damaged_names,
                                                     CORRUPT_STEPS)
        same_steps = {"outcome": outcome, "as_expected": ok, "silent": silent, "lost": again_lost,
                      **again.record()}
        auto_silent, lost = auto_silent or silent, lost or again_lost
        raw += raw_tracebacks(again)
    unverified = None
    if kind == "deleted-checksums":
        unverified, its_raw = unverified_leg(workspace, trial_dir, damaged_copy)
        raw += its_raw
    non_finite = [found for copy in sorted(trial_dir.iterdir()) if (copy / "checkpoints").is_dir()
                  for found in non_finite_checkpoints(copy, started)]
    result.update(
        explicit={"as_expected": explicit_ok, "names_the_file": explicit_names_file,
                  "one_line": refused_in_one_line(explicit), "refusal": refusal, **explicit.record()},
        auto={"outcome": auto_outcome, "as_expected": auto_ok, **auto.record()},
        same_steps=same_steps, unverified=unverified, lost=lost,
        silent_corrupt_resume=explicit_silent or auto_silent, non_finite_checkpoints=non_finite,
        code_executed=marker.exists(), raw_tracebacks=raw,
        as_expected=(explicit_ok and auto_ok and not raw and not marker.exists() and not non_finite
                     and (unverified is None or unverified["as_expected"])))
    workspace.discard(trial_dir)
    return result


def _say(trial: dict) -> None:
    print(f"  {trial['kind']:18s} {trial['index']:2d} | {trial['base']:9s} | "
          f"{trial['damage']['newest']} | explicit "
          f"{'ok' if trial['explicit']['as_expected'] else 'UNEXPECTED'} | auto {trial['auto']['outcome']}"
          + (" (ok)" if trial["auto"]["as_expected"] else " UNEXPECTED")
          + (f" | same steps: {trial['same_steps']['outcome']}"
             + (" (ok)" if trial["same_steps"]["as_expected"] else " UNEXPECTED")
             if trial["same_steps"] else "")
          + (f" | verify=false: {trial['unverified']['outcome']}"
             + (" (ok)" if trial["unverified"]["as_expected"] else " UNEXPECTED")
             if trial["unverified"] else "")
          + (" | NON-FINITE CHECKPOINT" if trial["non_finite_checkpoints"] else "")
          + (" | LOST" if trial["lost"] else "") + (" | SILENT" if trial["silent_corrupt_resume"] else "")
          + (" | CODE RAN" if trial["code_executed"] else "")
          + (f" | {len(trial['raw_tracebacks'])} raw traceback(s)" if trial["raw_tracebacks"] else ""),
          flush=True)


def _counts(trials) -> dict:
    return {
        "trials": len(trials),
        "explicit_refused_as_expected": sum(t["explicit"]["as_expected"] for t in trials),
        "explicit_not_one_line": sum(not t["explicit"]["one_line"] for t in trials),
        "explicit_not_naming_the_file": sum(not t["explicit"]["names_the_file"] for t in trials),
        "auto_as_expected": sum(t["auto"]["as_expected"] for t in trials),
        "same_steps_as_expected": sum(bool(t["same_steps"] and t["same_steps"]["as_expected"])
                                      for t in trials),
        "same_steps_trials": sum(bool(t["same_steps"]) for t in trials),
        "unverified_as_expected": sum(bool(t["unverified"] and t["unverified"]["as_expected"])
                                      for t in trials),
        "unverified_trials": sum(bool(t["unverified"]) for t in trials),
        "non_finite_checkpoints_written": sum(len(t["non_finite_checkpoints"]) for t in trials),
        "silent_corrupt_resumes": sum(t["silent_corrupt_resume"] for t in trials),
        "code_executed": sum(t["code_executed"] for t in trials),
        "raw_traceback_trials": sum(bool(t["raw_tracebacks"]) for t in trials),
        "lost": sum(t["lost"] for t in trials),
    }


def run_part(workspace: Workspace, args) -> dict:
    kinds = args.kinds or list(CORRUPTIONS)
    indices = [args.trial] if args.trial is not None else list(range(args.trials))
    bases = base_runs(workspace)
    trials = []
    for kind in kinds:
        for index in indices:
            trials.append(corrupt_trial(workspace, kind, index, bases, args.seed))
            _say(trials[-1])
    by_kind = {}
    for kind in kinds:
        mine = [t for t in trials if t["kind"] == kind]
        by_kind[kind] = {**_counts(mine),
                         "auto_outcomes": sorted({re.sub(r"step_\d+|/\S+", "…", t["auto"]["outcome"])
                                                  for t in mine}),
                         "same_steps": [t["same_steps"]["outcome"] for t in mine if t["same_steps"]]}
    tally = {**_counts(trials),
             "commands": sum(2 + bool(t["same_steps"]) + bool(t["unverified"]) for t in trials)}
    line = (f"corrupt | trials {tally['trials']} ({len(kinds)} kinds) | lost {tally['lost']} | "
            f"--resume <ckpt> refused as expected {tally['explicit_refused_as_expected']} | "
            f"--resume auto as expected {tally['auto_as_expected']} | silent corrupt resumes "
            f"{tally['silent_corrupt_resumes']} | code executed {tally['code_executed']} | raw tracebacks "
            f"{tally['raw_traceback_trials']} | same-steps resume as expected "
            f"{tally['same_steps_as_expected']}/{tally['same_steps_trials']} | non-finite checkpoints "
            f"written {tally['non_finite_checkpoints_written']}"
            + (f" | verify=false as expected {tally['unverified_as_expected']}/{tally['unverified_trials']}"
               if tally["unverified_trials"] else ""))
    return {"tally": tally, "tally_line": line, "by_kind": by_kind, "trials": trials}
