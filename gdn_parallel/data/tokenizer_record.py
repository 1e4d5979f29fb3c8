"""What the data records about how its ids were made from text, for the trainer: the files a
checkpoint carries of the tokenizer (so that an export names it wherever the checkpoint is copied),
and the UTF-8 bytes each validation token stands for (val_bpb's denominator).

Checkpoint files (checkpoint/manager.py `seal` writes them; gdn-convert to-hf reads them):

    tokenizer_info.json   the tokenizer's identity: {"kind": "bytes", "vocab_size": 256} (ids are the
                          UTF-8 bytes of the text), or kind "tokenizers" with file, sha256, vocab_size
                          and special_tokens (bos_token / eos_token / pad_token: {content, id, from} or null)
    tokenizer.json        (kind "tokenizers") the tokenizer, verbatim

Data that does not record its tokenizer (a Megatron dataset; a blend of differing records; a
prepared dataset from before copies were kept whose tokenizer file is no longer where it was) gives
no files: its checkpoints say nothing of a tokenizer, and so does an export of them.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .documents import Documents
from .prepared import read_metadata
from .text_tokenizer import ByteTokenizer

TOKENIZER_INFO = "tokenizer_info.json"
TOKENIZER_JSON = "tokenizer.json"


def _info(identity: dict) -> bytes:
    return (json.dumps(identity, indent=1, sort_keys=True) + "\n").encode("utf-8")


def tokenizer_files(dataset) -> dict[str, bytes]:
    """File name -> bytes of what a checkpoint trained on `dataset` carries of its tokenizer ({} when
    the data does not record one)."""
    if dataset.kind == "bytes":
        return {TOKENIZER_INFO: _info(ByteTokenizer().identity())}
    if dataset.kind == "prepared":
        return prepared_tokenizer_files(dataset.source)
    if dataset.kind == "blend":
        found = [tokenizer_files(part) for part in dataset.parts]
        return found[0] if found and all(files == found[0] for files in found) else {}
    return {}


def prepared_tokenizer_files(source: str) -> dict[str, bytes]:
    """The tokenizer files of a prepared dataset: its copy of tokenizer.json (checked against the
    sha256 it was prepared with), or, in a dataset prepared before copies were kept, the original
    file if it is still where it was and unchanged."""
    metadata = read_metadata(source)
    identity = metadata.get("tokenizer", {})
    if identity.get("kind") == "bytes":
        return {TOKENIZER_INFO: _info(identity)}
    if identity.get("kind") != "tokenizers":
        return {}
    copy = metadata.get("tokenizer_copy")
    path = Path(os.path.expanduser(source)) / copy if copy else Path(str(identity.get("file", "")))
    if not path.is_file():
        if copy:
            raise ConfigError(f"data.source={source!r}: its tokenizer copy {path} is missing; prepare it "
                              f"again (gdn-prepare-data ... --force)")
        return {}
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != identity.get("sha256"):
        if copy:
            raise ConfigError(f"data.source={source!r}: {path} is not the tokenizer the data was prepared "
                              f"with (its sha256 differs from the metadata's); prepare it again")
        return {}
    return {TOKENIZER_JSON: data, TOKENIZER_INFO: _info(identity)}


def one_byte_per_token(documents: Documents) -> Documents:
    """Byte-level documents' bytes per token: 1 each (a view, no memory per token)."""
    return Documents(np.broadcast_to(np.uint8(1), documents.tokens.shape), documents.starts,
                     documents.lengths)
