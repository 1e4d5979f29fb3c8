"""Hugging Face weight files through the `safetensors` library (the optional `[convert]` extra).

A folder holds `model.safetensors`, or shards `model-00001-of-00003.safetensors` ... with
`model.safetensors.index.json` mapping every tensor name to its shard (the hub's layout, what
`save_pretrained` writes). Files carry `__metadata__ = {"format": "pt"}`, which transformers requires.
A file the library cannot read is refused in one line naming it.
"""
from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from .errors import ConvertError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"   # save_pretrained's default max_shard_size
INSTALL = "pip install 'gdn-parallel[convert]'"

_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def _library():
    """The safetensors package: (safe_open, save_file, its error type); a ConvertError saying what to
    install when it is missing."""
    try:
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import save_file
    except ImportError:
        raise ConvertError(f"Hugging Face folders are read and written with the safetensors package, which "
                           f"is not installed: {INSTALL}") from None
    return safe_open, save_file, SafetensorError


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 bytes, '500MiB' -> 500 * 2**20, '123' -> 123 (the hub's units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ConvertError(f"--shard-size {text!r} is not a size; write a positive number with a unit, e.g. "
                           f"5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _, save_file, _ = _library()
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(path),
              metadata={"format": "pt"})


def is_safetensors(path: Path) -> bool:
    """Whether the file starts as a safetensors file does (a header length, then a JSON object)."""
    with open(path, "rb") as fh:
        start = fh.read(9)
    return len(start) == 9 and start[8:] == b"{" and 0 < struct.unpack("<Q", start[:8])[0] < 2 ** 30


def _damaged(path: Path, detail: str) -> ConvertError:
    return ConvertError(f"{path} is not a readable safetensors file (damaged header: {detail})")


def _opened(path: Path):
    """safe_open of `path`, after the one check the library words differently: a header length past
    the end of the file (named in bytes, never allocated)."""
    safe_open, _, library_error = _library()
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            start = fh.read(8)
    except OSError as err:
        raise _damaged(path, str(err)) from None
    if len(start) < 8:
        raise _damaged(path, f"the file has {size} bytes, fewer than the 8 of a header length")
    (length,) = struct.unpack("<Q", start)
    if length > size - 8:
        raise _damaged(path, f"its header length {length:,} exceeds the {size:,}-byte file")
    try:
        return safe_open(str(path), framework="pt")
    except (library_error, OSError, ValueError) as err:
        raise _damaged(path, str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def read_header(path: Path) -> list[str]:
    """The tensor names of one file."""
    with _opened(path) as handle:
        return list(handle.keys())


def read_file(path: Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    _, _, library_error = _library()
    with _opened(path) as handle:
        wanted = list(handle.keys()) if names is None else list(names)
        try:
            return {name: handle.get_tensor(name) for name in wanted}
        except (library_error, OSError, ValueError) as err:   # a truncated file fails at its tensor
            raise ConvertError(f"{path}: a tensor cannot be read ({str(err).splitlines()[0]})") from None


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most max_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + _nbytes(tensor) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(tensor)
    return shards


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Writes the weights into `folder`; returns the file names written."""
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_file(folder / SINGLE_FILE, tensors)
        return [SINGLE_FILE]
    weight_map, written = {}, []
    for index, names in enumerate(shards, start=1):
        name = shard_name(index, len(shards))
        write_file(folder / name, {n: tensors[n] for n in names})
        weight_map.update({n: name for n in names})
        written.append(name)
    index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()),
                          "total_size": sum(_nbytes(t) for t in tensors.values())},
             "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return written + [INDEX_FILE]


def folder_files(folder: Path) -> dict[str, list[str]]:
    """shard file -> the tensor names it holds, per the index (or the single file); every listed
    shard must exist."""
    folder = Path(folder)
    index_path, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ConvertError(f"{index_path} is not a safetensors index (no weight_map: {err})") from None
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(shard, []).append(name)
        missing = sorted(shard for shard in files if not (folder / shard).is_file())
        if missing:
            raise ConvertError(f"{folder} is missing shard(s) {missing} listed in {INDEX_FILE}; copy the "
                               f"whole folder (every shard) and try again")
        return files
    if single.is_file():
        return {SINGLE_FILE: read_header(single)}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = (f"it has {found} but no {INDEX_FILE} saying which tensor is where" if found
            else "it has no .safetensors weights (a PyTorch .bin checkpoint? load and re-save it with "
                 "save_pretrained(safe_serialization=True))")
    raise ConvertError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}: {hint}")


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in folder_files(folder).items():
        absent = sorted(set(names) - set(read_header(folder / shard)))
        if absent:
            raise ConvertError(f"{folder / shard} lacks tensor(s) {absent[:5]} that {INDEX_FILE} places "
                               f"there; the index and the shards are from different saves")
        tensors.update(read_file(folder / shard, names))
    return tensors
