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
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
CONFIG_COPY = "config.yaml"
ABANDONED = "abandoned"
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
