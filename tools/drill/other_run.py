"""Part other-run: another run's checkpoint in a run's out_dir. A finished run's step_4 (one process,
or dp=2) is replaced by step_4 of a run with another seed: copied over it ("replaced") or as a
symbolic link to it ("linked"). Then, as a user would type them:

- `--resume <step_4>` and `--resume auto` must refuse in one line (status 2) naming the checkpoint,
  both run ids and the opt-in checkpoint.allow_other_run=true; once per kind the finished run's own
  command (train.steps = 4) too, which must not take it for the run's end;
- `--resume auto --set checkpoint.allow_other_run=true` must resume it, say whose it is, and end with
  a checkpoint that verifies and records the out_dir's run id and the other run as resumed_from_run;
- the other run's step_4 resumed into a fresh out_dir (no run_id.json: fine-tuning a released
  checkpoint) must resume without the flag under a new run id that records where it came from.

An other-run resume without the flag is any `resume | <step_4>` line of the first kind of command.
No command may write a checkpoint that is not finite."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .corruption import CORRUPT_STEPS, RESUME_STEPS, base_runs
from .processes import Finished, Workspace, run, train_argv
from .reading import (
    ERROR_PREFIX,
    final_checkpoint_ok,
    non_finite_checkpoints,
    raw_tracebacks,
    refusal_line,
    refused_in_one_line,
    resume_report,
)

KINDS = ("replaced", "linked")
ALLOW = "checkpoint.allow_other_run=true"


def run_id_of(out_dir: Path) -> str:
    return json.loads((out_dir / "run_id.json").read_text())["run_id"]


def judge_refusal(finished: Finished, foreign: Path, ids: tuple[str, str], linked: bool) -> dict:
    """A command that must refuse another run's checkpoint: one line, status 2, naming the checkpoint,
    both run ids and the opt-in (and the link, for a linked one)."""
    refusal = refusal_line(finished) or ""
    named = (str(foreign) in refusal and all(run_id in refusal for run_id in ids) and ALLOW in refusal
             and ("symbolic link" in refusal) == linked)
    resumed_it = str(resume_report(finished).loaded) == str(foreign)
    return {"as_expected": finished.status == 2 and refused_in_one_line(finished) and named,
            "names_checkpoint_ids_and_flag": named, "other_run_resumed_without_flag": resumed_it,
            "refusal": refusal[len(ERROR_PREFIX):], **finished.record()}


def judge_resumed(finished: Finished, out_dir: Path, checkpoint: Path, run_id: str, theirs: str) -> dict:
    """A command that must resume another run's `checkpoint` (with the opt-in, or into a fresh out_dir)
    to the end, its final checkpoint recording `run_id` and `theirs` as resumed_from_run."""
    final_ok, why = final_checkpoint_ok(out_dir, RESUME_STEPS)
    final = out_dir / "checkpoints" / f"step_{RESUME_STEPS}" / "trainer_state.json"
    recorded = json.loads(final.read_text()) if final_ok else {}
    line = next((line for line in finished.lines() if line.startswith(f"resume | {checkpoint} | step ")), "")
    ok = (finished.status == 0 and final_ok and theirs in line
          and (recorded.get("run_id"), recorded.get("resumed_from_run")) == (run_id, theirs))
    return {"as_expected": ok, "lost": not (finished.status == 0 and final_ok), "resume_line": line,
            "final": why, "recorded": {k: recorded.get(k) for k in ("run_id", "resumed_from_run")},
            **finished.record()}


def other_run_trial(workspace: Workspace, kind: str, index: int, bases: dict[str, Path], seed: int) -> dict:
    base_name = "1 process" if index % 2 == 0 else "dp=2"
    trial_dir = workspace.directory(f"other_run_{kind}_{index}")
    started = time.time()   # the checkpoints sealed after it are the trial's commands' own
    source = bases["another seed"] / "checkpoints" / "step_4"
    ids = (run_id_of(bases[base_name]), run_id_of(bases["another seed"]))
    ran: list[Finished] = []

    def command(name: str, out_dir: Path, steps: int, resume: str, overrides=()) -> Finished:
        ran.append(run(workspace, train_argv(workspace, out_dir, steps, overrides, resume=resume),
                       trial_dir / name))
        return ran[-1]

    def prepared(name: str) -> tuple[Path, Path]:
        """A copy of the base run whose step_4 is the other run's (copied over it, or linked)."""
        out_dir = trial_dir / name
        shutil.copytree(bases[base_name], out_dir)
        foreign = out_dir / "checkpoints" / "step_4"
        shutil.rmtree(foreign)
        if kind == "linked":
            foreign.symlink_to(source, target_is_directory=True)
        else:
            shutil.copytree(source, foreign)
        return out_dir, foreign

    out_dir, foreign = prepared("run")
    asked = {"explicit": (RESUME_STEPS, str(foreign)), "auto": (RESUME_STEPS, "auto")}
    if index == 0:   # the finished run's own command: train.steps at the foreign checkpoint's step
        asked["same_steps"] = (CORRUPT_STEPS, "auto")
    refusals = {name: judge_refusal(command(name, out_dir, steps, resume), foreign, ids, kind == "linked")
                for name, (steps, resume) in asked.items()}
    allowed_dir, allowed_foreign = prepared("allowed")
    allowed = judge_resumed(command("allowed", allowed_dir, RESUME_STEPS, "auto", [ALLOW]), allowed_dir,
                            allowed_foreign, ids[0], ids[1])
    fresh_dir = trial_dir / "fresh"
    fresh_run = command("fresh", fresh_dir, RESUME_STEPS, str(source))
    new_id = run_id_of(fresh_dir) if (fresh_dir / "run_id.json").is_file() else ""
    fresh = judge_resumed(fresh_run, fresh_dir, source, new_id, ids[1])
    fresh["as_expected"] = fresh["as_expected"] and new_id not in ("", ids[1])
    raw = [found for finished in ran for found in raw_tracebacks(finished)]
    non_finite = [found for copy in sorted(trial_dir.iterdir()) if (copy / "checkpoints").is_dir()
                  for found in non_finite_checkpoints(copy, started)]
    result = {"kind": kind, "index": index, "base": base_name, "ids": {"ours": ids[0], "theirs": ids[1]},
              "reproduce": f"python3 tools/fault_drill.py other-run --seed {seed} --trial {index}",
              **refusals, "allowed": allowed, "fresh": fresh, "raw_tracebacks": raw,
              "non_finite_checkpoints": non_finite, "commands": len(ran),
              "other_run_resumes_without_flag": sum(r["other_run_resumed_without_flag"]
                                                    for r in refusals.values()),
              "lost": allowed["lost"] or fresh["lost"] or any(finished.hung for finished in ran)}
    result["as_expected"] = (all(r["as_expected"] for r in refusals.values()) and allowed["as_expected"]
                             and fresh["as_expected"] and not raw and not non_finite)
    workspace.discard(trial_dir)
    return result


def _say(trial: dict) -> None:
    refused = [name for name in ("explicit", "auto", "same_steps") if name in trial]
    print(f"  {trial['kind']:8s} {trial['index']:2d} | {trial['base']:9s} | refused "
          + ", ".join(f"{name} {'ok' if trial[name]['as_expected'] else 'UNEXPECTED'}" for name in refused)
          + f" | {ALLOW} {'ok' if trial['allowed']['as_expected'] else 'UNEXPECTED'}"
          + f" | fresh out_dir {'ok' if trial['fresh']['as_expected'] else 'UNEXPECTED'}"
          + (f" | {trial['other_run_resumes_without_flag']} OTHER-RUN RESUME(S) WITHOUT THE FLAG"
             if trial["other_run_resumes_without_flag"] else "")
          + (" | NON-FINITE CHECKPOINT" if trial["non_finite_checkpoints"] else "")
          + (" | LOST" if trial["lost"] else "")
          + (f" | {len(trial['raw_tracebacks'])} raw traceback(s)" if trial["raw_tracebacks"] else ""),
          flush=True)


def run_part(workspace: Workspace, args) -> dict:
    indices = [args.trial] if args.trial is not None else list(range(args.trials))
    bases = base_runs(workspace, ("1 process", "dp=2", "another seed"))
    trials = []
    for kind in KINDS:
        for index in indices:
            trials.append(other_run_trial(workspace, kind, index, bases, args.seed))
            _say(trials[-1])
    refusal_commands = [trial[name] for trial in trials for name in ("explicit", "auto", "same_steps")
                        if name in trial]
    tally = {
        "trials": len(trials), "commands": sum(t["commands"] for t in trials),
        "refused_as_expected": sum(r["as_expected"] for r in refusal_commands),
        "refusal_commands": len(refusal_commands),
        "other_run_resumes_without_flag": sum(t["other_run_resumes_without_flag"] for t in trials),
        "allowed_as_expected": sum(t["allowed"]["as_expected"] for t in trials),
        "fresh_as_expected": sum(t["fresh"]["as_expected"] for t in trials),
        "non_finite_checkpoints_written": sum(len(t["non_finite_checkpoints"]) for t in trials),
        "raw_traceback_trials": sum(bool(t["raw_tracebacks"]) for t in trials),
        "lost": sum(t["lost"] for t in trials),
    }
    line = (f"other-run | trials {tally['trials']} ({len(KINDS)} kinds) | lost {tally['lost']} | refused "
            f"as expected {tally['refused_as_expected']}/{tally['refusal_commands']} | other-run resumes "
            f"without the flag {tally['other_run_resumes_without_flag']} | with {ALLOW} as expected "
            f"{tally['allowed_as_expected']}/{tally['trials']} | into a fresh out_dir as expected "
            f"{tally['fresh_as_expected']}/{tally['trials']} | non-finite checkpoints written "
            f"{tally['non_finite_checkpoints_written']} | raw tracebacks {tally['raw_traceback_trials']}")
    return {"tally": tally, "tally_line": line, "trials": trials}
