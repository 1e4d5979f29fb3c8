"""Part 3: a full disk. A run writes into a small tmpfs until a save fails: it must end with status 4
and one line naming the path, the space a checkpoint takes and the space free, remove its `.partial`,
and leave the earlier checkpoints, metrics.jsonl and loss.png intact. The tmpfs is then enlarged and
`--resume auto` must finish the run from the newest checkpoint. Every tmpfs is unmounted, also on failure."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from gdn_parallel.checkpoint import complete_checkpoints

from .processes import Workspace, run, shell_line, train_argv
from .reading import (
    damage_of,
    final_checkpoint_ok,
    metrics_intact,
    newest_complete,
    png_intact,
    raw_tracebacks,
    refusal_line,
    refused_in_one_line,
    resume_report,
    step_of,
)

DISK_STEPS = 6
# (checkpoints that fit, fraction of one more checkpoint also free, async save): the save that fails
# runs out of space at varying points of its tensor data.
DISK_CASES = ((1, 0.3, False), (2, 0.5, True), (1, 0.8, False), (2, 0.2, False), (1, 0.6, True))


def checkpoint_bytes(workspace: Workspace) -> tuple[int, int]:
    """(bytes of one checkpoint, bytes of the rest of out_dir) of a DISK_STEPS run, measured."""
    out_dir = workspace.directory("measure") / "run"
    argv = train_argv(workspace, out_dir, DISK_STEPS, ["checkpoint.interval=0"])
    finished = run(workspace, argv, out_dir.parent / "measure")
    if finished.status != 0:
        raise RuntimeError(f"the measuring run failed: {shell_line(argv)}\n{finished.stderr[-3000:]}")
    checkpoint = newest_complete(out_dir)
    size = sum(_allocated(p) for p in checkpoint.iterdir()) + 4096
    rest = sum(_allocated(p) for p in out_dir.iterdir() if p.is_file())
    shutil.rmtree(out_dir.parent, ignore_errors=True)
    return size, rest


def _allocated(path: Path) -> int:
    """Bytes a file takes on tmpfs: whole pages."""
    return -(-path.stat().st_size // 4096) * 4096


def disk_full_trial(workspace: Workspace, index: int, case: tuple[int, float, bool], sizes: tuple[int, int],
                    seed: int) -> dict:
    fit, fraction, async_save = case
    checkpoint_size, rest = sizes
    # metrics.jsonl and loss.png grow with the run: room for their final size and 64 KiB more
    size = int(fit * checkpoint_size + rest + (64 << 10) + fraction * checkpoint_size)
    size -= size % 4096
    mount = workspace.root / f"disk{index}"
    out_dir = mount / "run"
    workspace.mount_tmpfs(mount, size)
    result = {"index": index, "tmpfs_bytes": size,
              "checkpoints_expected_to_fit": fit, "async_save": async_save,
              "reproduce": f"python3 tools/fault_drill.py disk-full --seed {seed} --trial {index}"}
    try:
        argv = train_argv(workspace, out_dir, DISK_STEPS,
                          ["checkpoint.interval=1", f"checkpoint.async_save={str(async_save).lower()}"])
        full = run(workspace, argv, workspace.root / f"disk{index}_full")
        refusal = refusal_line(full) or ""
        match = re.search(r"saving checkpoint (\S+) failed", refusal)
        complete = complete_checkpoints(str(out_dir))
        checks = {
            "status 4": full.status == 4,
            "one line naming the path": refused_in_one_line(full) and bool(match) and str(out_dir) in refusal,
            "space needed": "A checkpoint takes about" in refusal,
            "space free": "are free on that file system" in refusal,
            ".partial removed": not list((out_dir / "checkpoints").glob("*.partial")),
            "earlier checkpoints verify": bool(complete) and all(damage_of(p) is None for p in complete),
            "metrics.jsonl intact": metrics_intact(out_dir)[0],
            "loss.png intact": png_intact(out_dir / "loss.png")[0],
        }
        failed_at = step_of(Path(match.group(1))) if match else None
        usage = shutil.disk_usage(mount)
        # Not required (the brief asks for the path, the space needed and free), but what a user reads first.
        result.update(full=full.record(), refusal=refusal, failed_save=failed_at,
                      cause_says_no_space="No space left on device" in refusal,
                      complete_before_resume=[p.name for p in complete], free_after_failure=usage.free,
                      loss_png=png_intact(out_dir / "loss.png")[1], metrics=metrics_intact(out_dir)[1])

        workspace.resize_tmpfs(mount, size + (DISK_STEPS + 1) * checkpoint_size)
        resumed = run(workspace, argv + ["--resume", "auto"], workspace.root / f"disk{index}_resume")
        report = resume_report(resumed)
        newest = complete[-1] if complete else None
        final_ok, final_detail = final_checkpoint_ok(out_dir, DISK_STEPS)
        checks.update({
            "resume status 0": resumed.status == 0,
            "resumed the newest": newest is not None and report.loaded == newest,
            "final checkpoint verifies": final_ok,
            "metrics.jsonl intact after resume": metrics_intact(out_dir)[0],
            "loss.png intact after resume": png_intact(out_dir / "loss.png")[0],
        })
        raw = raw_tracebacks(full) + raw_tracebacks(resumed)
        result.update(resume=resumed.record(), resumed_from=str(report.loaded) if report.loaded else None,
                      final=final_detail, checks=checks,
                      failed_checks=[k for k, ok in checks.items() if not ok],
                      raw_tracebacks=raw, lost=not (checks["resume status 0"] and final_ok
                                                     and checks["resumed the newest"]))
    finally:
        workspace.unmount(mount)
    return result


def run_part(workspace: Workspace, args) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("fault_drill disk-full: mounting a tmpfs needs root")
    sizes = checkpoint_bytes(workspace)
    indices = [args.trial] if args.trial is not None else list(range(len(DISK_CASES)))
    trials = []
    for index in indices:
        trial = disk_full_trial(workspace, index, DISK_CASES[index], sizes, args.seed)
        trials.append(trial)
        print(f"  disk {index} | tmpfs {trial['tmpfs_bytes'] / 2**20:.1f} MiB | save "
              f"step_{trial['failed_save']} failed | {trial['refusal'][:150]} | "
              f"resumed {trial['resumed_from']} | "
              + ("all checks pass" if not trial["failed_checks"] else f"FAILED: {trial['failed_checks']}"),
              flush=True)
    tally = {"runs": len(trials), "checkpoint_bytes": sizes[0],
             "cause_says_no_space": sum(t["cause_says_no_space"] for t in trials),
             "as_expected": sum(not t["failed_checks"] for t in trials),
             "lost": sum(t["lost"] for t in trials),
             "raw_traceback_runs": sum(bool(t["raw_tracebacks"]) for t in trials),
             "failed_checks": sorted({c for t in trials for c in t["failed_checks"]})}
    line = (f"disk-full | runs {tally['runs']} | as expected {tally['as_expected']} | lost {tally['lost']} | "
            f"raw tracebacks {tally['raw_traceback_runs']}"
            + (f" | failed checks: {', '.join(tally['failed_checks'])}" if tally["failed_checks"] else ""))
    return {"tally": tally, "tally_line": line, "trials": trials}


