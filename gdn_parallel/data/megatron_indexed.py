"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read from its format alone.

`data.source` names the prefix as Megatron does (`path/name_text_document`), or either file. The index
holds, little-endian:

    magic      9 bytes  b"MMIDIDX\\x00\\x00"
    version    uint64   1
    dtype      uint8    the token dtype's code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16;
                        6 float64 and 7 float32 are not token ids and are refused)
    sequences  uint64   S
    documents  uint64   D + 1 (the document index starts with 0)
    lengths    int32 [S]      tokens per sequence
    pointers   int64 [S]      byte offset of each sequence in the .bin
    doc index  int64 [D + 1]  document i is sequences doc_index[i] .. doc_index[i + 1] - 1

(a multimodal index adds an int8 mode per sequence: refused, its tokens are not all text). The .bin is
the sequences' tokens back to back. Our document i is Megatron's document i: its sequences in order,
which lie end to end in the .bin (preprocess_data.py writes one sequence per document unless it
splits sentences); empty documents are left out, as for prepared datasets.

Opening checks all that is cheap (magic, version, dtype, the index's size against its counts, the
document index, every pointer against the lengths, the .bin's size) and names the file and what is
wrong. The index records no largest id, so `largest_token_id` reads the .bin once per process.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER = struct.Struct("<9sQBQQ")    # magic, version, dtype code, sequence count, document count
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
NOT_TOKEN_DTYPES = {6: "float64", 7: "float32"}
SCAN_CHUNK = 1 << 24                 # tokens per step of the id scan: bounded memory on any corpus

_WRITE_AGAIN = "write it again with Megatron-LM's tools/preprocess_data.py (or copy it whole again)"
_id_ranges: dict[tuple[str, int, int], tuple[int, int]] = {}   # the scans already done in this process


@dataclass
class MegatronIndexed:
    prefix: str
    tokens: np.ndarray        # memory map of the .bin, 1-D
    offsets: np.ndarray       # int64 [documents + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    num_sequences: int

    @property
    def num_documents(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def dtype_name(self) -> str:
        return self.tokens.dtype.name


def megatron_prefix(source: str) -> str | None:
    """The prefix when `source` names a Megatron indexed dataset (the prefix, its .bin or its .idx,
    either file present), else None."""
    if source == "stdlib":
        return None
    expanded = os.path.expanduser(source)
    for suffix in (".bin", ".idx"):
        if expanded.endswith(suffix) and Path(expanded[:-len(suffix)] + ".idx").is_file():
            return expanded[:-len(suffix)]
    if Path(expanded + ".idx").is_file() or Path(expanded + ".bin").is_file():
        return expanded
    return None


def open_megatron(source: str) -> MegatronIndexed:
    """Open the dataset `source` names (checked; the tokens as a memory map)."""
    prefix = megatron_prefix(source) or os.path.expanduser(source)
    idx_path, bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise ConfigError(f"data.source={source!r}: {path} is missing; a Megatron indexed dataset is a "
                              f".bin and an .idx of one prefix")
    try:
        dtype, lengths, pointers, doc_index = _read_index(source, idx_path)
        size = bin_path.stat().st_size
    except OSError as err:
        raise ConfigError(f"data.source={source!r}: {err.filename} cannot be read ({err.strerror})") from None
    itemsize = dtype().itemsize
    num_tokens = int(lengths.sum(dtype=np.int64))
    if size != num_tokens * itemsize:
        raise ConfigError(f"data.source={source!r}: {bin_path} holds {size:,} bytes but its index says "
                          f"{num_tokens:,} {np.dtype(dtype).name} tokens ({num_tokens * itemsize:,} bytes): "
                          f"{'truncated' if size < num_tokens * itemsize else 'not the data of this index'}; "
                          f"{_WRITE_AGAIN}")
    # Token offset of every sequence start, then of every document start (the last: the end).
    sequence_starts = np.append(pointers // itemsize, num_tokens)
    offsets = np.ascontiguousarray(sequence_starts[doc_index])
    tokens = (np.memmap(bin_path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(num_tokens,))
              if num_tokens else np.zeros(0, dtype=dtype))   # np.memmap cannot map an empty file
    return MegatronIndexed(prefix=prefix, tokens=tokens, offsets=offsets, num_sequences=int(lengths.shape[0]))


def _read_index(source: str, idx_path: Path):
    where = f"data.source={source!r}: the index {idx_path}"
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as handle:
        header = handle.read(HEADER.size)
    if len(header) < HEADER.size:
        raise ConfigError(f"{where} holds {size} bytes, less than its {HEADER.size}-byte header: truncated; "
                          f"{_WRITE_AGAIN}")
    magic, version, code, num_sequences, num_doc_index = HEADER.unpack(header)
    if magic != INDEX_MAGIC:
        raise ConfigError(f"{where} starts with {magic!r}, not Megatron's {INDEX_MAGIC!r}: not a Megatron "
                          f"indexed dataset, or damaged; {_WRITE_AGAIN}")
    if version != INDEX_VERSION:
        raise ConfigError(f"{where} has format version {version}; this reader knows version {INDEX_VERSION}")
    if code in NOT_TOKEN_DTYPES:
        raise ConfigError(f"{where} stores {NOT_TOKEN_DTYPES[code]} values (dtype code {code}), not token "
                          f"ids")
    if code not in TOKEN_DTYPES:
        raise ConfigError(f"{where} has dtype code {code}, none of Megatron's {sorted(TOKEN_DTYPES)}: "
                          f"damaged; {_WRITE_AGAIN}")
    expected = HEADER.size + 12 * num_sequences + 8 * num_doc_index
    if size == expected + num_sequences and num_sequences:
        raise ConfigError(f"{where} holds a mode per sequence (a multimodal dataset): not text tokens only")
    if size != expected:
        raise ConfigError(f"{where} holds {size:,} bytes; its header's {num_sequences:,} sequences and "
                          f"{num_doc_index:,} document-index entries need {expected:,}: "
                          f"{'truncated' if size < expected else 'damaged'}; {_WRITE_AGAIN}")
    lengths = np.memmap(idx_path, dtype="<i4", mode="r", offset=HEADER.size, shape=(num_sequences,)) \
        if num_sequences else np.zeros(0, dtype=np.int32)
    pointers = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER.size + 4 * num_sequences,
                         shape=(num_sequences,)) if num_sequences else np.zeros(0, dtype=np.int64)
    doc_index = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER.size + 12 * num_sequences,
                          shape=(num_doc_index,)) if num_doc_index else np.zeros(0, dtype=np.int64)
    problem = _index_problem(lengths, pointers, doc_index, num_sequences, TOKEN_DTYPES[code]().itemsize)
    if problem:
        raise ConfigError(f"{where} is damaged: {problem}; {_WRITE_AGAIN}")
    return TOKEN_DTYPES[code], lengths, pointers, doc_index


def _index_problem(lengths, pointers, doc_index, num_sequences: int, itemsize: int) -> str | None:
    if doc_index.shape[0] == 0 or doc_index[0] != 0 or doc_index[-1] != num_sequences:
        return f"its document index must run from 0 to the {num_sequences:,} sequences"
    falls = np.flatnonzero(np.diff(doc_index) < 0)
    if falls.size:
        return f"its document index falls after entry {int(falls[0])}"
    if num_sequences == 0:
        return None
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        return f"sequence {int(negative[0])} has length {int(lengths[negative[0]])}"
    # Megatron writes each sequence right after the one before: pointer = previous pointer + its bytes.
    expected = np.zeros(num_sequences, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected[1:])
    wrong = np.flatnonzero(pointers != expected)
    if wrong.size:
        first = int(wrong[0])
        return (f"sequence {first} points at byte {int(pointers[first]):,}, but the sequences before it "
                f"end at byte {int(expected[first]):,} (pointers must rise by each sequence's bytes)")
    return None


def largest_token_id(source: str, dataset: MegatronIndexed) -> int:
    """The largest token id in the .bin (-1 when it holds none), read once per process: the index
    records none. Raises ConfigError naming the file when it holds a negative id (signed dtypes)."""
    path = dataset.prefix + ".bin"
    stat = Path(path).stat()
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _id_ranges:
        low, high = 0, -1
        for start in range(0, dataset.tokens.shape[0], SCAN_CHUNK):
            chunk = dataset.tokens[start:start + SCAN_CHUNK]
            low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
        _id_ranges[key] = (low, high)
    low, high = _id_ranges[key]
    if low < 0:
        raise ConfigError(f"data.source={source!r}: {path} holds the token id {low}; token ids are >= 0: "
                          f"{_WRITE_AGAIN}")
    return high
