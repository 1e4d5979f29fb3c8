"""Hugging Face weight files, read and written with torch alone (no safetensors package needed).

A `.safetensors` file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte range; `__metadata__` -> {"format": "pt"}, which transformers requires), padded with spaces to
8 bytes, then the tensors' raw little-endian bytes back to back. A folder holds `model.safetensors`,
or shards `model-00001-of-00003.safetensors` ... with `model.safetensors.index.json` mapping every
tensor name to its shard (the hub's layout, what `save_pretrained` writes).
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch

from .errors import ConvertError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"   # save_pretrained's default max_shard_size

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


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


def write_file(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _CODES:
            raise ConvertError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot store")
        size = _nbytes(tensor)
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for tensor in tensors.values():
            fh.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def is_safetensors(path: Path) -> bool:
    """Whether the file starts as a safetensors file does (a header length, then a JSON object)."""
    with open(path, "rb") as fh:
        start = fh.read(9)
    return len(start) == 9 and start[8:] == b"{" and 0 < struct.unpack("<Q", start[:8])[0] < 2 ** 30


def read_header(path: Path) -> Dict[str, dict]:
    """name -> {dtype, shape, data_offsets} of one file (without `__metadata__`)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > size - 8:  # read before allocating: a damaged length asks for exabytes
                raise ValueError(f"its header length {length:,} exceeds the {size:,}-byte file")
            header = json.loads(fh.read(length))
    except (OSError, struct.error, ValueError) as err:
        raise ConvertError(f"{path} is not a readable safetensors file (damaged header: {err})") from None
    if not isinstance(header, dict) or not all(
            isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)
            for k, e in header.items() if k != "__metadata__"):
        raise ConvertError(f"{path} is not a readable safetensors file (damaged header: entries lack dtype, shape "
                           f"or data_offsets)")
    header.pop("__metadata__", None)
    return header


def read_file(path: Path, names: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    header = read_header(path)
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        start = 8 + length
        tensors = {}
        for name in (header if names is None else names):
            entry = header[name]
            if entry["dtype"] not in _DTYPES:
                raise ConvertError(f"{path}: tensor {name} has dtype {entry['dtype']}, which torch cannot hold")
            begin, end = entry["data_offsets"]
            fh.seek(start + begin)
            raw = bytearray(fh.read(end - begin))
            if len(raw) != end - begin:
                raise ConvertError(f"{path} is truncated: tensor {name} needs bytes {begin}..{end} of its data")
            tensors[name] = torch.frombuffer(raw, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"]) \
                if raw else torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
    return tensors


def plan_shards(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[List[str]]:
    """Names in order, cut into shards of at most max_bytes (a larger tensor gets a shard of its own)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + _nbytes(tensor) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(tensor)
    return shards


def write_folder(folder: Path, tensors: Dict[str, torch.Tensor], max_shard_bytes: int) -> List[str]:
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


def folder_files(folder: Path) -> Dict[str, List[str]]:
    """shard file -> the tensor names it holds, per the index (or the single file); every listed
    shard must exist."""
    index_path, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ConvertError(f"{index_path} is not a safetensors index (no weight_map: {err})") from None
        files: Dict[str, List[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(shard, []).append(name)
        missing = sorted(shard for shard in files if not (folder / shard).is_file())
        if missing:
            raise ConvertError(f"{folder} is missing shard(s) {missing} listed in {INDEX_FILE}; copy the whole "
                               f"folder (every shard) and try again")
        return files
    if single.is_file():
        return {SINGLE_FILE: list(read_header(single))}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = (f"it has {found} but no {INDEX_FILE} saying which tensor is where" if found
            else "it has no .safetensors weights (a PyTorch .bin checkpoint? load and re-save it with "
                 "save_pretrained(safe_serialization=True))")
    raise ConvertError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}: {hint}")


def read_folder(folder: Path) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for shard, names in folder_files(folder).items():
        header = read_header(folder / shard)
        absent = sorted(set(names) - set(header))
        if absent:
            raise ConvertError(f"{folder / shard} lacks tensor(s) {absent[:5]} that {INDEX_FILE} places there; "
                               f"the index and the shards are from different saves")
        tensors.update(read_file(folder / shard, names))
    return tensors
