"""Checksums of a checkpoint's files: recorded when it is sealed, verified before it is loaded.

`checksums.json` lists every file of the checkpoint with its size and, for each 64 MiB piece, two
64-bit sums of its 4 KiB blocks read as 64-bit words: the sum of all words, and the sum of each
block's sum weighted by the block's place (modulo 2^64; the tail is padded with zeros). The second
catches blocks moved or swapped (a misdirected write), the first any changed word: a flipped bit,
a zeroed page, a truncated or torn copy. Why not CRC-32: at memory speed on memory-mapped files
these sums ran at 55 GB/s on 8 threads of an H100 host against 13 for zlib's CRC-32, and with CRC
verifying a 1.3B checkpoint (14.8 GiB) took 18% of its load (tools/bench_checkpoint.py, docs/
reliability.md). numpy releases the GIL while it sums, so a pool of threads shares the pieces; in a
job of many processes each process takes a share of the files. A checksum catches damage, not
forgery: what keeps a forged checkpoint from running code is reading.py.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "checksums.json"
PIECE_BYTES = 64 << 20
BLOCK_WORDS = 512                      # 4 KiB blocks of 64-bit words
MANIFEST_VERSION = 1


def _threads() -> int:
    return max(1, min(8, (os.cpu_count() or 1)))


def _piece_sums(path: Path, index: int, size: int) -> list[int]:
    """[sum of words, sum of block sums weighted by block number] of piece `index` of the file."""
    begin = index * PIECE_BYTES
    length = min(PIECE_BYTES, size - begin)
    if length <= 0:  # an empty file
        return [0, 0]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=begin, shape=(length,))
    whole = length - length % (8 * BLOCK_WORDS)
    blocks = data[:whole].view(np.uint64).reshape(-1, BLOCK_WORDS).sum(axis=1, dtype=np.uint64)
    if whole < length:  # the tail, zero-padded to a block
        tail = np.zeros(8 * BLOCK_WORDS, dtype=np.uint8)
        tail[:length - whole] = data[whole:]
        blocks = np.append(blocks, tail.view(np.uint64).sum(dtype=np.uint64))
    places = np.arange(1, blocks.shape[0] + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return [int(blocks.sum(dtype=np.uint64)), int((blocks * places).sum(dtype=np.uint64))]


def checksums(directory: Path, names: Sequence[str]) -> dict[str, dict]:
    """{"size": bytes, "sum64": [[the two sums] of each 64 MiB piece]} of each named file of
    `directory`, every piece of every file shared out to one pool of threads."""
    directory = Path(directory)
    sizes = {name: (directory / name).stat().st_size for name in names}
    jobs = [(name, index) for name in names for index in range(max(1, -(-sizes[name] // PIECE_BYTES)))]
    with ThreadPoolExecutor(_threads()) as pool:
        sums = list(pool.map(lambda job: _piece_sums(directory / job[0], job[1], sizes[job[0]]), jobs))
    found: dict[str, dict] = {name: {"size": sizes[name], "sum64": []} for name in names}
    for (name, _), piece in zip(jobs, sums):
        found[name]["sum64"].append(piece)
    return found


def write_manifest(directory: Path, entries: dict[str, dict]) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, "files": entries}))


@dataclass(frozen=True)
class Damage:
    """Why a checkpoint fails verification: the first file found wrong, and how."""
    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


def read_manifest(directory: Path) -> dict[str, dict] | None:
    """The recorded checksums, or None when the checkpoint has none (written before they existed).
    A damaged manifest is itself damage (raises ValueError naming it by its name in the checkpoint, as
    Damage names a file: the caller's message names the checkpoint)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        ok = isinstance(files, dict) and all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sum64"), list)
            for e in files.values())
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{MANIFEST} cannot be read ({type(err).__name__}: {err})") from None
    if not ok or data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{MANIFEST} is not a version {MANIFEST_VERSION} checksum list")
    return files


def find_damage(directory: Path, names: Sequence[str], recorded: dict[str, dict]) -> list[Damage]:
    """Check the named files of `directory` against their recorded checksums."""
    damage, present = [], []
    for name in names:
        path, expected = Path(directory) / name, recorded[name]
        if not path.is_file():
            damage.append(Damage(name, "missing"))
        elif path.stat().st_size != expected["size"]:
            damage.append(Damage(name, f"{path.stat().st_size} bytes, {expected['size']} when it was written "
                                       f"(truncated or overwritten)"))
        else:
            present.append(name)
    for name, found in checksums(Path(directory), present).items():
        expected_sums = [list(piece) for piece in recorded[name]["sum64"]]
        wrong = [i for i, (a, b) in enumerate(zip(found["sum64"], expected_sums)) if a != b]
        if wrong or len(found["sum64"]) != len(expected_sums):
            first = wrong[0] if wrong else 0
            where = f"bytes {first * PIECE_BYTES}..{min(found['size'], (first + 1) * PIECE_BYTES)}"
            damage.append(Damage(name, f"checksum mismatch ({where}): the file changed after it was written"))
    return damage
