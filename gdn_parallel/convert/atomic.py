"""Outputs appear whole or not at all: everything is written under a temporary sibling name and
renamed at the end, so a failed or interrupted conversion leaves nothing at the destination (an
existing destination is refused, never overwritten)."""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..config import creation_problem
from .errors import ConvertError


def refuse_existing(path: Path) -> None:
    if Path(path).exists():
        raise ConvertError(f"{path} already exists; remove it or choose another output path (nothing is "
                           f"overwritten)")


def check_new_output(path, argument: str) -> None:
    """Before anything is read: the output `path` (the command's `argument`, e.g. OUT_DIR) must not
    exist (the converters overwrite nothing) and must be creatable, so that a bad path is refused at
    once, not after the checkpoint was read."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        kind = "a directory" if path.is_dir() else "a file"
        raise ConvertError(f"{argument} {path} already exists ({kind}); remove it or choose another path "
                           f"(nothing is overwritten)")
    check_creatable(path, argument)


def check_creatable(path, argument: str) -> None:
    """ConvertError naming `argument` when `path` could not be created (config.creation_problem)."""
    problem = creation_problem(path)
    if problem is not None:
        raise ConvertError(f"{argument} {path} cannot be created: {problem}; choose a path in a directory "
                           f"you can write")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def _renamed_into_place(path: Path, directory: bool) -> Iterator[Path]:
    """Yields a temporary sibling of `path` (an empty directory, or a file name to write) that is
    renamed to `path` when the block succeeds. Missing parent directories are created, and removed
    again (those still empty) when it fails."""
    path = Path(path)
    refuse_existing(path)
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
    missing = [parent for parent in path.absolute().parents if not parent.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove(temporary)  # left by an earlier process of the same id
    try:
        if directory:
            temporary.mkdir()
        yield temporary
        refuse_existing(path)  # another process may have made it meanwhile
        os.replace(temporary, path)
    except BaseException:
        _remove(temporary)
        for parent in missing:  # innermost first; only if still empty
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    finally:
        _remove(temporary)


def new_directory(path: Path):
    """Context manager: an empty temporary directory that becomes `path` when the block succeeds."""
    return _renamed_into_place(path, directory=True)


def new_file(path: Path):
    """Context manager: a temporary file path that becomes `path` when the block succeeds."""
    return _renamed_into_place(path, directory=False)
