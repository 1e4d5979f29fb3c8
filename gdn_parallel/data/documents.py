"""Documents as one flat token array and where each document lies in it.

Byte corpora (held in memory) and prepared datasets (a memory map of tokens.bin) look the same to
the batch stream: `Documents.piece(i, begin, end)` copies out tokens of document i as int64, and
nothing else is ever materialised, so a dataset larger than memory streams from disk.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

DocumentLike = torch.Tensor | bytes | bytearray | Sequence[int]


@dataclass(frozen=True)
class Documents:
    tokens: np.ndarray     # 1-D, any integer dtype (uint8 bytes, uint16/uint32 memory map, int64)
    starts: np.ndarray     # int64 [num_documents]: where each document starts in `tokens`
    lengths: np.ndarray    # int64 [num_documents], every one > 0

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def piece(self, index: int, begin: int, end: int) -> torch.Tensor:
        """Tokens [begin, end) of document `index`, a fresh int64 tensor."""
        start = int(self.starts[index])
        return torch.from_numpy(self.tokens[start + begin:start + end].astype(np.int64))

    def document(self, index: int) -> torch.Tensor:
        return self.piece(index, 0, int(self.lengths[index]))

    def subset(self, indices: np.ndarray) -> Documents:
        indices = np.asarray(indices, dtype=np.int64)
        return Documents(self.tokens, self.starts[indices], self.lengths[indices])

    @classmethod
    def from_offsets(cls, tokens: np.ndarray, offsets: np.ndarray) -> Documents:
        """Documents i = tokens[offsets[i]:offsets[i + 1]]; empty documents are left out."""
        offsets = np.asarray(offsets, dtype=np.int64)
        starts, lengths = offsets[:-1], np.diff(offsets)
        keep = lengths > 0
        return cls(tokens, np.ascontiguousarray(starts[keep]), np.ascontiguousarray(lengths[keep]))

    @classmethod
    def from_sequences(cls, documents: Sequence[DocumentLike]) -> Documents:
        """Copy documents (1-D tensors, bytes, or sequences of ids) into one array; empty ones are
        left out. Raises ValueError for a tensor that is not 1-D."""
        arrays = [_as_array(doc) for doc in documents]
        arrays = [a for a in arrays if a.size > 0]
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(tokens, offsets[:-1], lengths)


def _as_array(doc: DocumentLike) -> np.ndarray:
    if isinstance(doc, torch.Tensor):
        if doc.dim() != 1:
            raise ValueError(f"documents must be 1-D token sequences, got shape {tuple(doc.shape)}")
        return doc.detach().cpu().numpy()
    if isinstance(doc, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(doc), dtype=np.uint8)
    return np.asarray(list(doc), dtype=np.int64)
