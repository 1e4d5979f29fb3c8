"""The on-disk format of a prepared (tokenized) dataset, and its reader.

prepare.py (gdn-prepare-data) writes a directory holding

    gdn_tokens.json   the metadata (written last: a directory without it is not finished)
    tokens.bin        every document's token ids back to back, raw little-endian uint16 (when the
                      vocabulary fits) or uint32, read through a memory map
    offsets.npy       the document index: int64 [num_documents + 1], document i is
                      tokens[offsets[i]:offsets[i + 1]]; offsets[0] = 0, offsets[-1] = num_tokens
    token_bytes.bin   (a tokenizer file only) per token, the UTF-8 bytes of the document's text it
                      stands for (data/text_tokenizer.py text_bytes_per_token: a document's counts add
                      up to its bytes), raw little-endian uint8 / uint16 / uint32; val_bpb divides by them
    tokenizer.json    (a tokenizer file only) the tokenizer, copied verbatim (checkpoints carry it)

The metadata holds: format, format_version, dtype, vocab_size (the tokenizer's), max_token_id (the
largest id in tokens.bin, so start-up never scans the tokens), num_tokens, num_documents, tokenizer
(its identity: kind 'bytes', or kind 'tokenizers' with the file's name, sha256 and special_tokens
{bos_token, eos_token, pad_token: {content, id, from} or null}), tokenizer_copy (the copy's name),
text_bytes (the UTF-8 bytes of the documents: {num_bytes, each_token: 1} for bytes, {num_bytes, file,
dtype} with a tokenizer; absent in datasets prepared before it was recorded: val_bpb is then unknown),
text_key, sources (the input files) and skipped (binary files, empty documents).

Opening checks everything that is cheap to check (sizes, the index's shape, order and ends) and
raises ConfigError naming data.source with the fix.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError

METADATA_FILE = "gdn_tokens.json"
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
TOKEN_BYTES_FILE = "token_bytes.bin"
TOKENIZER_COPY = "tokenizer.json"
PARTIAL_DIR = ".partial"          # gdn-prepare-data's work in progress
FORMAT_NAME = "gdn-parallel-tokens"
FORMAT_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")

_PREPARE_AGAIN = "prepare it again: gdn-prepare-data ... --out DIR --force"


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype that holds every id of a vocabulary."""
    if vocab_size <= 2 ** 16:
        return "uint16"
    if vocab_size <= 2 ** 32:
        return "uint32"
    raise ValueError(f"a vocabulary of {vocab_size:,} ids does not fit in uint32")


def is_prepared_dir(source: str) -> bool:
    """Whether `source` is a directory holding a prepared dataset (finished or not)."""
    if source == "stdlib":   # the name of the built-in corpus, never a path
        return False
    path = Path(os.path.expanduser(source))
    return (path / METADATA_FILE).is_file() or (path / PARTIAL_DIR).is_dir()


@dataclass
class PreparedDataset:
    path: Path
    metadata: dict
    tokens: np.ndarray       # memory map of tokens.bin, 1-D
    offsets: np.ndarray      # int64 [num_documents + 1] (memory map)
    token_bytes: np.ndarray | None = None   # UTF-8 bytes per token, aligned with tokens; None: unknown

    @property
    def num_documents(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_token_id(self) -> int:
        return int(self.metadata["max_token_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.metadata["vocab_size"])

    def tokenizer_name(self) -> str:
        return describe_tokenizer(self.metadata.get("tokenizer", {}))


def describe_tokenizer(identity: dict) -> str:
    if identity.get("kind") == "tokenizers":
        return f"tokenizers {identity.get('file', '?')} (sha256 {str(identity.get('sha256', ''))[:12]})"
    return str(identity.get("kind", "unknown"))


def read_metadata(source: str) -> dict:
    """The checked metadata of a prepared dataset directory (without opening the tokens)."""
    path = Path(os.path.expanduser(source))
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        if (path / PARTIAL_DIR).is_dir():
            raise ConfigError(f"data.source={source!r} holds an unfinished preparation ({PARTIAL_DIR}/ "
                              f"without {METADATA_FILE}); finish it by running gdn-prepare-data "
                              f"again with the same arguments (it resumes)")
        raise ConfigError(f"data.source={source!r} has no {METADATA_FILE}: not a prepared dataset")
    try:
        metadata = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"data.source={source!r}: {METADATA_FILE} cannot be read ({err}); "
                          f"{_PREPARE_AGAIN}") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise ConfigError(f"data.source={source!r}: {METADATA_FILE} {problem}; {_PREPARE_AGAIN}")
    return metadata


def _metadata_problem(metadata) -> str | None:
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        return f"is not a {FORMAT_NAME} metadata file"
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        return (f"has format_version {version!r}; this gdn_parallel reads version {FORMAT_VERSION} "
                f"(prepare it again with this version's gdn-prepare-data)")
    if metadata.get("dtype") not in TOKEN_DTYPES:
        return f"has dtype {metadata.get('dtype')!r}, not one of {TOKEN_DTYPES}"
    for key in ("vocab_size", "max_token_id", "num_tokens", "num_documents"):
        value = metadata.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"has {key}={value!r}, not a count"
    if metadata["max_token_id"] >= metadata["vocab_size"] and metadata["num_tokens"]:
        return (f"says max_token_id={metadata['max_token_id']} but vocab_size={metadata['vocab_size']}: "
                f"ids must be below the vocabulary size")
    return None


def open_prepared(source: str) -> PreparedDataset:
    """Open a prepared dataset: metadata, a memory map of the tokens, the document index."""
    metadata = read_metadata(source)
    path = Path(os.path.expanduser(source))
    dtype = np.dtype(metadata["dtype"]).newbyteorder("<")
    num_tokens, num_documents = metadata["num_tokens"], metadata["num_documents"]
    tokens_path = path / TOKENS_FILE
    if not tokens_path.is_file():
        raise ConfigError(f"data.source={source!r}: {TOKENS_FILE} is missing; {_PREPARE_AGAIN}")
    size = tokens_path.stat().st_size
    if size != num_tokens * dtype.itemsize:
        raise ConfigError(f"data.source={source!r}: {TOKENS_FILE} holds {size:,} bytes but the metadata says "
                          f"{num_tokens:,} {dtype.name} tokens ({num_tokens * dtype.itemsize:,} bytes): "
                          f"truncated or replaced; {_PREPARE_AGAIN}")
    offsets = _open_offsets(source, path / OFFSETS_FILE, num_tokens, num_documents)
    # np.memmap cannot map an empty file; a dataset without tokens is refused when its documents are read
    tokens = (np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,)) if num_tokens
              else np.zeros(0, dtype=dtype))
    return PreparedDataset(path=path, metadata=metadata, tokens=tokens, offsets=offsets,
                           token_bytes=_open_token_bytes(source, path, metadata))


def _open_token_bytes(source: str, path: Path, metadata: dict) -> np.ndarray | None:
    """The UTF-8 bytes each token stands for (text_bytes in the metadata), or None when the dataset
    does not record them."""
    record, num_tokens = metadata.get("text_bytes"), metadata["num_tokens"]
    where = f"data.source={source!r}: {METADATA_FILE}'s text_bytes"
    if record is None:
        return None
    if not isinstance(record, dict) or not _is_count(record.get("num_bytes")):
        raise ConfigError(f"{where} {record!r} has no num_bytes count; {_PREPARE_AGAIN}")
    if record.get("each_token") == 1:
        return np.broadcast_to(np.uint8(1), (num_tokens,))   # a view: no memory per token
    if record.get("file") != TOKEN_BYTES_FILE or record.get("dtype") not in ("uint8",) + TOKEN_DTYPES:
        raise ConfigError(f"{where} {record!r} names neither each_token: 1 nor file {TOKEN_BYTES_FILE!r} "
                          f"with a uint dtype; {_PREPARE_AGAIN}")
    file, dtype = path / TOKEN_BYTES_FILE, np.dtype(record["dtype"]).newbyteorder("<")
    size = file.stat().st_size if file.is_file() else None
    if size != num_tokens * dtype.itemsize:
        found = "is missing" if size is None else f"holds {size:,} bytes"
        raise ConfigError(f"data.source={source!r}: {TOKEN_BYTES_FILE} {found}, not {num_tokens:,} "
                          f"{dtype.name} counts (one per token); {_PREPARE_AGAIN}")
    return np.memmap(file, dtype=dtype, mode="r", shape=(num_tokens,)) if num_tokens else np.zeros(0, dtype)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _open_offsets(source: str, offsets_path: Path, num_tokens: int, num_documents: int) -> np.ndarray:
    where = f"data.source={source!r}: the document index {OFFSETS_FILE}"
    if not offsets_path.is_file():
        raise ConfigError(f"{where} is missing; {_PREPARE_AGAIN}")
    try:
        offsets = np.load(offsets_path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ConfigError(f"{where} cannot be read ({err}); {_PREPARE_AGAIN}") from None
    if offsets.dtype != np.int64 or offsets.shape != (num_documents + 1,):
        raise ConfigError(f"{where} is {offsets.dtype} {offsets.shape}, not int64 ({num_documents + 1},) as "
                          f"the metadata's {num_documents:,} documents need; {_PREPARE_AGAIN}")
    if offsets[0] != 0 or offsets[-1] != num_tokens or bool((np.diff(offsets) < 0).any()):
        raise ConfigError(f"{where} is corrupt (it must rise from 0 to the {num_tokens:,} tokens); "
                          f"{_PREPARE_AGAIN}")
    return offsets
