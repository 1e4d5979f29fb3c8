"""The ways the drill damages a checkpoint: torn, flipped, zeroed and deleted files, pickles
planted in its files with the checksums rewritten to match (what whoever planted them can do), its
checksums.json deleted (with bytes flipped where nothing can see them), and a data file replaced by a
symbolic link to a file outside the checkpoint. A planted pickle that ran would create the trial's
marker file."""
from __future__ import annotations

import os
import pickle
import random
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from gdn_parallel.checkpoint import integrity


class Gadget:
    """Unpickling this calls function(*arguments): the code a forged checkpoint file would run."""

    def __init__(self, function, arguments: tuple):
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


def gadget(rng: random.Random, marker: Path) -> tuple[str, Gadget]:
    """One of several ways a pickle runs code; each creates `marker`."""
    choices = {
        "open": Gadget(open, (str(marker), "w")),
        "os.system": Gadget(os.system, (f"touch {shlex.quote(str(marker))}",)),
        "exec": Gadget(exec, (f"open({str(marker)!r}, 'w').close()",)),
    }
    name = rng.choice(sorted(choices))
    return name, choices[name]


def data_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("__*_*.distcp"))


def rng_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("rng_rank*.pt"))


def truncate(path: Path, rng: random.Random) -> dict:
    size = path.stat().st_size
    keep = rng.randrange(0, size)
    with open(path, "r+b") as handle:
        handle.truncate(keep)
    return {"file": path.name, "kept_bytes": keep, "of_bytes": size}


def flip_bytes(path: Path, rng: random.Random) -> dict:
    count = rng.randint(1, 16)
    offset = rng.randrange(0, path.stat().st_size - count)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = bytearray(handle.read(count))
        for i in range(count):
            data[i] ^= rng.randint(1, 255)
        handle.seek(offset)
        handle.write(data)
    return {"file": path.name, "offset": offset, "bytes": count}


def zero_block(path: Path, rng: random.Random) -> dict:
    """A 4 KiB block zeroed (a lost page write); a block that is zeros already is no damage, so
    another is taken."""
    blocks = max(1, path.stat().st_size // 4096)
    with open(path, "r+b") as handle:
        for _ in range(1000):
            block = rng.randrange(0, blocks)
            handle.seek(block * 4096)
            data = handle.read(4096)
            if any(data):
                handle.seek(block * 4096)
                handle.write(bytes(len(data)))
                return {"file": path.name, "offset": block * 4096, "bytes": len(data)}
    raise RuntimeError(f"{path}: no non-zero block found")


def delete(path: Path) -> dict:
    path.unlink()
    return {"file": path.name}


def _sealed(checkpoint: Path, file: str, gadget_name: str, where: str) -> dict:
    """Rewrite checksums.json to match the files as they are now; what was planted, for the record."""
    recorded = integrity.read_manifest(checkpoint)
    names = sorted(name for name in recorded if (checkpoint / name).exists())
    integrity.write_manifest(checkpoint, integrity.checksums(checkpoint, names))
    return {"file": file, "gadget": gadget_name, "where": where, "checksums": "rewritten to match"}


def plant_in_metadata(checkpoint: Path, rng: random.Random, marker: Path) -> dict:
    name, payload = gadget(rng, marker)
    index = checkpoint / ".metadata"
    if rng.random() < 0.5:   # inside the genuine index, where DCP would carry it along
        with open(index, "rb") as handle:
            metadata = pickle.load(handle)   # the drill's own file, written by the run it just made
        metadata.planner_data = payload
        index.write_bytes(pickle.dumps(metadata))
        where = "planner_data of the genuine index"
    else:
        index.write_bytes(pickle.dumps(payload))
        where = "the whole file"
    return _sealed(checkpoint, ".metadata", name, where)


def _planter(files: Callable[[Path], list[Path]], wrap: Callable[[Gadget], object], wrapped: str):
    """A damage that replaces one of `files` by the gadget: in torch.save's format (`wrap` puts it
    where torch.save's reader would meet it) or as a plain pickle, half the time each."""
    def plant(checkpoint: Path, rng: random.Random, marker: Path) -> dict:
        name, payload = gadget(rng, marker)
        target = rng.choice(files(checkpoint))
        if rng.random() < 0.5:
            torch.save(wrap(payload), target)
            where = wrapped
        else:
            target.write_bytes(pickle.dumps(payload))
            where = "the whole file (a plain pickle)"
        return _sealed(checkpoint, target.name, name, where)
    return plant


def delete_checksums(checkpoint: Path, rng: random.Random) -> dict:
    """checksums.json deleted and 1 to 16 bytes of a data file flipped (issue 44: such a checkpoint was
    loaded without a word, trained to NaN and saved the NaN state)."""
    (checkpoint / integrity.MANIFEST).unlink()
    return {"file": integrity.MANIFEST, "flipped": flip_bytes(rng.choice(data_files(checkpoint)), rng)}


def link_data_out(checkpoint: Path, rng: random.Random, marker: Path) -> dict:
    """A data file replaced by a symbolic link to a file outside the checkpoint (beside the trial's
    marker): a copy of its own bytes (its checksums match as they are) or of the same file of another
    checkpoint of the run, with the checksums rewritten to match."""
    victim = rng.choice(data_files(checkpoint))
    siblings = [path for path in checkpoint.parent.glob(f"step_*/{victim.name}") if path.parent != checkpoint]
    source = victim if rng.random() < 0.5 or not siblings else rng.choice(siblings)
    outside = marker.parent / f"outside_{checkpoint.name}_{victim.name}"
    shutil.copy(source.resolve(), outside)
    victim.unlink()
    victim.symlink_to(outside)
    done = _sealed(checkpoint, victim.name, "-", "-")
    return {"file": victim.name, "link_to": str(outside),
            "bytes_of": "itself" if source == victim else f"{source.parent.name}/{source.name}",
            "checksums": done["checksums"]}


# kind -> (damage(checkpoint, rng, marker) -> what was done, runs only on a one-process base)
CORRUPTIONS: dict[str, tuple[Callable[[Path, random.Random, Path], dict], bool]] = {
    "flipped-bytes": (lambda c, r, m: flip_bytes(r.choice(data_files(c)), r), False),
    "zeroed-block": (lambda c, r, m: zero_block(r.choice(data_files(c)), r), False),
    "truncated-data": (lambda c, r, m: truncate(r.choice(data_files(c)), r), False),
    "deleted-data": (lambda c, r, m: delete(r.choice(data_files(c))), False),
    "deleted-rng": (lambda c, r, m: delete(r.choice(rng_files(c))), False),
    "torn-trainer-state": (lambda c, r, m: truncate(c / "trainer_state.json", r), False),
    "torn-metadata": (lambda c, r, m: truncate(c / ".metadata", r), False),
    "torn-checksums": (lambda c, r, m: truncate(c / integrity.MANIFEST, r), False),
    "planted-metadata": (plant_in_metadata, False),
    # Resumed under another layout a run does not read the RNG files at all (the generators are
    # only restored under the same ranks): the planted file must be one the resume reads.
    "planted-rng": (_planter(rng_files, lambda payload: {"torch": torch.get_rng_state(), "python": payload},
                             "the python state of a torch.save file"), True),
    "planted-data": (_planter(data_files, lambda payload: payload, "the whole file (torch.save)"), False),
    "deleted-checksums": (lambda c, r, m: delete_checksums(c, r), False),
    "data-linked-out": (link_data_out, False),
}
