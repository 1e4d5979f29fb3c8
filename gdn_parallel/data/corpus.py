"""Byte-level corpora that need no preparation: the standard library, or text files.

`data.source = "stdlib"` (the default) reads this Python's standard-library sources: every `*.py`
file under `sysconfig.get_paths()["stdlib"]` (recursively, sorted, site-packages left out), each
file one document, taken as it is (the same files, and so the same batches, as before text checks
existed). Any other value is a directory, a file or a glob pattern of text files: which files are
read, and why binaries never are, is in gdn_parallel.data.text_files. Tokens are the raw bytes
(vocabulary 256); nothing is decoded and nothing is cached on disk.

Documents are split into train and validation by a hash of their path (relative to the source
root), so the split does not depend on the order files are found in nor on the machine. Training
is never left empty: a single document trains, and validation is empty then.
"""
from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import BYTE_VOCAB_SIZE, ConfigError, what_is_at
from .prepared import is_prepared_dir
from .text_files import describe_skipped, is_text, list_text_files, read_file, walk

__all__ = ["BYTE_VOCAB_SIZE", "Corpus", "load_corpus", "list_source_files", "split_fraction",
           "validation_mask", "stdlib_root"]


@dataclass
class Corpus:
    """Documents as 1-D uint8 tensors, split into train and validation, with their names."""
    source: str
    train: list[torch.Tensor]
    val: list[torch.Tensor]
    train_names: list[str] = field(default_factory=list)
    val_names: list[str] = field(default_factory=list)
    binary_skipped: int = 0      # files left out for NUL bytes or invalid UTF-8

    @property
    def num_train_tokens(self) -> int:
        return sum(int(d.numel()) for d in self.train)

    @property
    def num_val_tokens(self) -> int:
        return sum(int(d.numel()) for d in self.val)

    def describe(self) -> str:
        skipped = f", {self.binary_skipped:,} binary file(s) skipped" if self.binary_skipped else ""
        return (f"{self.source}: {len(self.train):,} train docs ({self.num_train_tokens:,} tokens), "
                f"{len(self.val):,} val docs ({self.num_val_tokens:,} tokens){skipped}")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(source: str, suffixes: Sequence[str] = ()) -> list[tuple[str, Path]]:
    """(name, path) of every file of a byte source, sorted by name; name is the path relative to
    the root. `suffixes` filters directory sources (() keeps every file); [] when nothing exists."""
    if source == "stdlib":
        return walk(stdlib_root(), lambda name: name.endswith(".py")).files
    listing = list_text_files(source, suffixes)
    return listing.files if listing is not None else []


def split_fraction(name: str) -> float:
    """A number in [0, 1) fixed by the document's name; below data.val_fraction -> validation."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def validation_mask(scores: Sequence[float] | np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents are held out, from their scores in [0, 1): those below val_fraction. With at
    least two documents and val_fraction > 0 one is always held out (the lowest score); training is
    never left empty (the highest score trains), so a single document trains."""
    values = np.asarray(scores, dtype=np.float64)
    is_val = values < val_fraction
    if val_fraction > 0 and values.size >= 2 and not is_val.any():
        is_val[int(np.argmin(values))] = True
    if values.size and is_val.all():
        is_val[int(np.argmax(values))] = False
    return is_val


def load_corpus(data_config) -> Corpus:
    """Read a byte source (`data.source`: stdlib, a directory, a file or a glob) into a train /
    validation Corpus of byte documents.

    Raises ConfigError (a ValueError) naming `data.source` when the source does not exist or is neither
    a directory nor a regular file (a device, a pipe: said which), yields no readable, non-empty text
    document, or is a prepared dataset (read those with gdn_parallel.data.load_dataset).
    """
    source = data_config.source
    if is_prepared_dir(source):
        raise ConfigError(f"data.source={source!r} is a prepared token dataset; read it with "
                          f"gdn_parallel.data.load_dataset (or TokenBatches.from_config), not load_corpus")
    named, binary, suffix_skipped = [], 0, None
    if source == "stdlib":
        files = list_source_files(source)
    else:
        listing = list_text_files(source, data_config.suffixes)
        if listing is None:  # neither a directory nor a regular file: say what it is
            raise ConfigError(f"data.source={source!r} {what_is_at(Path(source).expanduser())}: give "
                              f"'stdlib', a directory or file of text, a glob pattern (e.g. "
                              f"'corpus/**/*.txt') or a directory written by gdn-prepare-data")
        files, suffix_skipped = listing.files, listing.suffix_skipped
    for name, path in files:
        data = read_file(path)
        if not data:
            continue  # unreadable or empty: an empty document has no tokens to train on
        if source != "stdlib" and not is_text(data):
            binary += 1
            continue
        named.append((name, torch.frombuffer(bytearray(data), dtype=torch.uint8)))
    if not named:
        raise ConfigError(_no_documents_message(data_config, len(files), binary, suffix_skipped))
    is_val = validation_mask([split_fraction(name) for name, _ in named], float(data_config.val_fraction))
    corpus = Corpus(source=source, train=[], val=[], binary_skipped=binary)
    for (name, doc), val in zip(named, is_val.tolist()):
        (corpus.val if val else corpus.train).append(doc)
        (corpus.val_names if val else corpus.train_names).append(name)
    return corpus


def _no_documents_message(data_config, listed: int, binary: int, suffix_skipped) -> str:
    source = data_config.source
    reasons = []
    if suffix_skipped:
        reasons.append(f"files without a suffix of data.text_suffixes={data_config.text_suffixes!r} were "
                       f"left out ({describe_skipped(suffix_skipped)}): add theirs to data.text_suffixes "
                       f"or '*' for all")
    if binary:
        reasons.append(f"{binary} binary file(s) were skipped (NUL bytes or not UTF-8)")
    if listed - binary > 0:
        reasons.append(f"{listed - binary} file(s) were empty or unreadable")
    why = "; ".join(reasons) if reasons else "no file matched"
    return (f"data.source={source!r} yields no documents ({why}); give 'stdlib', a directory of text "
            f"files, a glob pattern (e.g. 'corpus/**/*.txt') matching readable, non-empty UTF-8 files, "
            f"or a directory written by gdn-prepare-data")
