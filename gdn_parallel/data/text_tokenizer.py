"""Text to token ids for tools/prepare_data.py: raw UTF-8 bytes, or a local Hugging Face `tokenizers`
tokenizer file (tokenizer.json). `tokenizers` is imported only when a file is given."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Sequence

import numpy as np

from ..config import BYTE_VOCAB_SIZE

BYTES = "bytes"


class ByteTokenizer:
    """The UTF-8 bytes of the text: the same ids data.source reads from text files."""
    vocab_size = BYTE_VOCAB_SIZE

    def identity(self) -> dict:
        return {"kind": BYTES, "vocab_size": self.vocab_size}

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class FileTokenizer:
    """A `tokenizers` tokenizer saved as JSON; its own post-processing (special tokens) applies."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"--tokenizer {path} needs the `tokenizers` package: pip install tokenizers "
                             f"(or use --tokenizer bytes)") from None
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no such file; give a tokenizer.json or 'bytes'")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:  # the library raises its own Exception type for a bad file
            raise ValueError(f"--tokenizer {path} is not a tokenizers JSON file ({err})") from None
        self.path = str(file.resolve())
        self.sha256 = hashlib.sha256(file.read_bytes()).hexdigest()
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def identity(self) -> dict:
        return {"kind": "tokenizers", "file": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size}

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in self._tokenizer.encode_batch(list(texts))]


def load_tokenizer(spec: str):
    """'bytes' or the path of a tokenizers JSON file."""
    return ByteTokenizer() if spec == BYTES else FileTokenizer(spec)
