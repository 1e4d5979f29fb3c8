"""Byte-level corpora that need no download.

`data.source = "stdlib"` (the default) reads this Python's standard-library sources: every `*.py`
file under `sysconfig.get_paths()["stdlib"]` (recursively, sorted, site-packages left out), each
file one document. Any other value is a directory (every regular file under it, recursively) or a
glob pattern of text files. Tokens are the raw bytes (vocabulary 256); nothing is decoded and
nothing is cached on disk.

Documents are split into train and validation by a hash of their path (relative to the source
root), so the split does not depend on the order files are found in nor on the machine.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

import torch

from ..config import BYTE_VOCAB_SIZE, ConfigError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    """Documents as 1-D uint8 tensors, split into train and validation, with their names."""
    source: str
    train: List[torch.Tensor]
    val: List[torch.Tensor]
    train_names: List[str] = field(default_factory=list)
    val_names: List[str] = field(default_factory=list)

    @property
    def num_train_tokens(self) -> int:
        return sum(int(d.numel()) for d in self.train)

    @property
    def num_val_tokens(self) -> int:
        return sum(int(d.numel()) for d in self.val)

    def describe(self) -> str:
        return (f"{self.source}: {len(self.train):,} train docs ({self.num_train_tokens:,} tokens), "
                f"{len(self.val):,} val docs ({self.num_val_tokens:,} tokens)")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(source: str) -> List[Tuple[str, Path]]:
    """(name, path) of every file of a source, sorted by name; name is the path relative to the root."""
    if source == "stdlib":
        return _walk(stdlib_root(), lambda name: name.endswith(".py"))
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return _walk(path, lambda name: True)
    if path.is_file():
        return [(path.name, path)]
    matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
    if matches:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(m)) for m in matches])
        files = [(os.path.relpath(os.path.abspath(m), root), Path(m)) for m in matches]
        return sorted((n, p) for n, p in files if p.is_file())
    return []


def _walk(root: Path, keep) -> List[Tuple[str, Path]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if keep(name):
                full = Path(dirpath) / name
                found.append((full.relative_to(root).as_posix(), full))
    found.sort()
    return found


def _read(path: Path):
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None  # unreadable (permissions, broken link, vanished): skipped
    if not data:
        return None  # an empty document has no tokens to train on
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_fraction(name: str) -> float:
    """A number in [0, 1) fixed by the document's name; below data.val_fraction -> validation."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def load_corpus(data_config) -> Corpus:
    """Read `data_config.source` into a train/validation Corpus of byte documents.

    Raises ConfigError (a ValueError) naming `data.source` when the source yields no readable,
    non-empty document.
    """
    source = data_config.source
    named = []
    for name, path in list_source_files(source):
        doc = _read(path)
        if doc is not None:
            named.append((name, doc))
    if not named:
        raise ConfigError(
            f"data.source={source!r} yields no documents: give 'stdlib', a directory of text files, "
            f"or a glob pattern (e.g. 'corpus/**/*.txt') matching readable, non-empty files")
    val_fraction = float(data_config.val_fraction)
    scores = [split_fraction(name) for name, _ in named]
    is_val = [s < val_fraction for s in scores]
    if val_fraction > 0 and len(named) >= 2:
        if not any(is_val):  # a small source: hold out the one document the hash ranks first
            is_val[min(range(len(named)), key=scores.__getitem__)] = True
        if all(is_val):  # never leave training empty
            is_val[max(range(len(named)), key=scores.__getitem__)] = False
    corpus = Corpus(source=source, train=[], val=[])
    for (name, doc), val in zip(named, is_val):
        (corpus.val if val else corpus.train).append(doc)
        (corpus.val_names if val else corpus.train_names).append(name)
    return corpus
