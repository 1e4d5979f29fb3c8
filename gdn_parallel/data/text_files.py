"""Which files of a text source are read, and which of them are text.

Shared by `data.source` (gdn_parallel.data.corpus) and prepare.py (gdn-prepare-data), so both accept the same
files:

- a directory is walked recursively, in sorted order; directories whose name starts with a dot
  (.git, .venv, caches) and package/cache directories (site-packages, __pycache__, node_modules) are
  not entered; a file is kept when its name ends with one of the suffixes (case-insensitive), every
  file when the suffix list is empty ('*');
- a single file, or the files a glob pattern matches, are taken whatever their suffix: the pattern
  already says which files are meant (a `**` glob skips dot directories by itself);
- a file that holds a NUL byte or is not valid UTF-8 is binary (a git pack, an image, a compiled
  file) and is skipped wherever it comes from. Text in another encoding is skipped too: convert it
  to UTF-8 first.
"""
from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}
GLOB_CHARACTERS = set("*?[")


@dataclass
class Listing:
    """The files of a source as (name, path), sorted by name (name: the path relative to the root),
    with what was left out by suffix (suffix -> count) for error messages."""
    files: list[tuple[str, Path]]
    suffix_skipped: Counter = field(default_factory=Counter)


def is_glob(source: str) -> bool:
    return bool(GLOB_CHARACTERS & set(source))


def walk(root: Path, keep: Callable[[str], bool]) -> Listing:
    """Every regular file under `root` whose name `keep` accepts, skipping dot and cache directories."""
    listing = Listing(files=[])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
        for name in filenames:
            full = Path(dirpath) / name
            if keep(name):
                listing.files.append((full.relative_to(root).as_posix(), full))
            else:
                listing.suffix_skipped[Path(name).suffix.lower() or name] += 1
    listing.files.sort()
    return listing


def has_suffix(name: str, suffixes: Sequence[str]) -> bool:
    """Whether `name` ends with one of `suffixes` (lower-case, e.g. '.txt'); () accepts every name."""
    return not suffixes or name.lower().endswith(tuple(suffixes))


def list_text_files(source: str, suffixes: Sequence[str]) -> Listing | None:
    """The files of a directory, a single file or a glob pattern; None when `source` names nothing
    that exists (a glob that matches no file gives an empty listing)."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return walk(path, lambda name: has_suffix(name, suffixes))
    if path.is_file():
        return Listing(files=[(path.name, path)])
    if not is_glob(source):
        return None
    matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
    files = [Path(m) for m in matches if Path(m).is_file()]
    if not files:
        return Listing(files=[])
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    return Listing(files=sorted((os.path.relpath(os.path.abspath(f), root), f) for f in files))


def is_text(data: bytes) -> bool:
    """UTF-8 without NUL bytes: what a text source reads. Binary files fail one or the other."""
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_file(path: Path) -> bytes | None:
    """The file's bytes; None when it cannot be read (permissions, a broken link, vanished)."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def describe_skipped(suffix_skipped: Counter, limit: int = 5) -> str:
    """'.bin x3, .csv x2, ...': the most frequent suffixes a directory walk left out."""
    common = suffix_skipped.most_common(limit)
    more = len(suffix_skipped) - len(common)
    text = ", ".join(f"{suffix} x{count}" for suffix, count in common)
    return text + (f" and {more} more suffix(es)" if more > 0 else "")
