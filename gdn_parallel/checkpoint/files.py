"""Where checkpoints live and which ones count.

    <train.out_dir>/checkpoints/step_<N>/        N = completed optimizer steps
        .metadata, *.distcp                       torch.distributed.checkpoint (model, optimizer)
        trainer_state.json                        step, data positions, config, layout (rank 0)
        config.yaml                               the resolved config, to resume with
        rng_rank<r>.pt                            each rank's random generator states
        COMPLETE                                  written last, after every rank has finished

A checkpoint is written under a temporary name (`step_<N>.partial`) and renamed once complete, so
an interrupted save never looks like a checkpoint: `--resume auto` takes the newest `step_<N>` that
holds COMPLETE and ignores everything else.

A rollback (resuming an older checkpoint into the run's own out_dir) starts a new line of the run:
the complete checkpoints past the resumed step belong to the abandoned line, and are moved to
`checkpoints/abandoned/<time>/` (kept, never resumed by `--resume auto`, never pruned).

    <train.out_dir>/run_id.json                   the run's identity, written at its first step

Every checkpoint records the run id in its trainer_state.json, so a checkpoint of another run copied
or linked into an out_dir is told from the run's own (loading.run_identity). A checkpoint's files are
read only from inside its directory: an entry that is a symbolic link out of it is refused
(`links_out_of`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from .errors import CheckpointError

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
CONFIG_COPY = "config.yaml"
ABANDONED = "abandoned"
RUN_ID_FILE = "run_id.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_dir(out_dir: str) -> Path:
    return Path(out_dir) / CHECKPOINTS


def final_path(out_dir: str, step: int) -> Path:
    return checkpoints_dir(out_dir) / f"step_{step}"


def partial_path(out_dir: str, step: int) -> Path:
    return checkpoints_dir(out_dir) / f"step_{step}.partial"


def step_of(path: Path) -> int | None:
    """N of a `step_<N>` directory, else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / TRAINER_STATE).is_file()


def incomplete_reason(path: Path) -> str:
    """Why step directory `path` is not a complete checkpoint ('' when it is)."""
    missing = [name for name in (COMPLETE, TRAINER_STATE) if not (path / name).is_file()]
    return f"no {' and no '.join(missing)}: an interrupted save, or a file deleted" if missing else ""


def complete_checkpoints(out_dir: str) -> list[Path]:
    """Complete checkpoints under out_dir, oldest first."""
    return [path for _, path in _complete_steps(out_dir)]


def step_directories(out_dir: str) -> list[Path]:
    """Every step_<N> directory under out_dir's checkpoints, complete or not, oldest first."""
    return [path for _, path in _steps(out_dir)]


def _complete_steps(out_dir: str) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under out_dir, oldest first."""
    return [(step, path) for step, path in _steps(out_dir) if is_complete(path)]


def _steps(out_dir: str) -> list[tuple[int, Path]]:
    """(step, path) of the step_<N> directories under out_dir, oldest first."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(out_dir: str) -> Path | None:
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def publish(out_dir: str, step: int) -> Path:
    """Give the sealed partial checkpoint of `step` its final name (rank 0, after every rank has
    written). A checkpoint of the same step from an earlier run is replaced."""
    partial, final = partial_path(out_dir, step), final_path(out_dir, step)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    return final


def prune(out_dir: str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep 0: delete none); returns the deleted."""
    if keep <= 0:
        return []
    old = complete_checkpoints(out_dir)[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def set_aside_after(out_dir: str, step: int) -> list[Path]:
    """Move the complete checkpoints of out_dir past `step` (an abandoned line, after a rollback to
    `step`) to checkpoints/abandoned/<time>/; returns where they went (rank 0, before training)."""
    later = [path for number, path in _complete_steps(out_dir) if number > step]
    if not later:
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = checkpoints_dir(out_dir) / ABANDONED / stamp
    suffix = 1
    while target.exists():  # two rollbacks within a second
        suffix += 1
        target = checkpoints_dir(out_dir) / ABANDONED / f"{stamp}-{suffix}"
    target.mkdir(parents=True)
    moved = []
    for path in later:
        moved.append(Path(shutil.move(str(path), str(target / path.name))))
    return moved


def run_id_file(out_dir: str) -> Path:
    return Path(out_dir) / RUN_ID_FILE


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def read_run_record(out_dir: str) -> dict | None:
    """<out_dir>/run_id.json: {"run_id", "created"} and, for a run begun from another run's checkpoint,
    "resumed_from_run" and "resumed_from"; None when out_dir has none yet (a fresh out_dir, or one
    written before runs had ids)."""
    file = run_id_file(out_dir)
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        record, why = None, f"{type(err).__name__}: {err}"
    else:
        why = "no run_id string in it"
    if not (isinstance(record, dict) and isinstance(record.get("run_id"), str) and record["run_id"]):
        raise CheckpointError(f"{file} cannot be read ({why}); it names the run this train.out_dir holds: "
                              f"restore it from a copy, or move it away to continue under a new run id")
    return record


def write_run_record(out_dir: str, record: dict) -> None:
    """Write <out_dir>/run_id.json whole or not at all (a temporary file renamed over it)."""
    file = run_id_file(out_dir)
    partial = file.with_name(f"{file.name}.partial")
    partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
    os.replace(partial, file)


def links_out_of(checkpoint: Path) -> list[tuple[str, Path]]:
    """(name, target) of each entry of checkpoint directory `checkpoint` that is a symbolic link
    resolving outside it. Its checksums would vouch for whatever file the link reaches (another run's,
    or any file), so such a checkpoint is not read."""
    return [(entry.name, entry.resolve()) for entry in sorted(Path(checkpoint).iterdir())
            if entry.is_symlink() and resolves_outside(entry, checkpoint)]


def resolves_outside(file: Path, checkpoint: Path) -> bool:
    """Whether `file` of checkpoint directory `checkpoint`, links followed, lies outside it."""
    return Path(file).resolve().parent != Path(checkpoint).resolve()
