"""Packing documents into fixed-size varlen batches.

A batch is `batch_size` rows of exactly `seq_len` tokens, concatenated into one packed row
`[1, batch_size * seq_len]` described by `cu_seqlens`. Documents are streamed in a shuffled order
(a new permutation every epoch, fixed by the seed); a document that does not fit in the room left in
a row is cut, and its remainder starts the next row as a new document piece. Every row boundary is
therefore a document boundary, nothing is padded, and no token is dropped: within an epoch every
token of every document appears exactly once.

Inside each piece `labels[t] = input_ids[t + 1]`; the last token of a piece has label -100 (no
target crosses a piece boundary). `position_ids` count from 0 at the start of every piece, so
`cu_seqlens` can be recovered from `position_ids == 0`.

The stream behind `packed_batches` (data-parallel sharding, resumption, concatenate packing) is
gdn_parallel.data.stream.TokenBatches.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from gdn_kernels.host_index import copy_to_device

from ..config import IGNORE_INDEX
from .documents import DocumentLike, Documents


@dataclass
class PackedBatch:
    input_ids: torch.Tensor      # [1, total] int64
    labels: torch.Tensor         # [1, total] int64, -100 at each piece's last token
    position_ids: torch.Tensor   # [1, total] int64, position inside the piece
    cu_seqlens: torch.Tensor     # [num_pieces + 1] int64, 0 ... total; always on the host
    # Set by label_count() and to(); not an init field, so dataclasses.replace (new labels) recounts.
    known_label_count: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_docs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_label_tokens(self) -> int:
        """Tokens with a target (label != -100): one fewer than the tokens of each piece."""
        return num_label_tokens(self.num_tokens, self.num_docs)

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max().item())

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        """Token tensors on `device`; `cu_seqlens` stays on the host, where the ops read it (chunk
        layouts, document lengths) and make their device copies once per tensor
        (gdn_kernels.host_index.on_device): read back from a GPU, every layer would wait for it."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return copy_to_device(t, device) if non_blocking else t.to(device)
        moved = PackedBatch(move(self.input_ids), move(self.labels), move(self.position_ids), self.cu_seqlens)
        moved.known_label_count = self.label_count()
        return moved

    def label_count(self) -> int:
        """Tokens with a target: counted once, on the host for batches moved by `to` (a batch made on
        a GPU is counted there, at the cost of one device sync)."""
        if self.known_label_count is None:
            self.known_label_count = int((self.labels != IGNORE_INDEX).sum())
        return self.known_label_count


def num_label_tokens(total_tokens: int, num_pieces: int) -> int:
    """Number of tokens that carry a label in a packed row of `num_pieces` document pieces."""
    return int(total_tokens) - int(num_pieces)


def pack_pieces(pieces: list[torch.Tensor]) -> PackedBatch:
    """Concatenate document pieces into one packed row with labels, positions and boundaries."""
    lengths = torch.tensor([p.numel() for p in pieces], dtype=torch.long)
    if lengths.numel() == 0 or bool((lengths <= 0).any()):
        raise ValueError("pack_pieces needs at least one piece and no empty pieces")
    input_ids = torch.cat([p.to(torch.long) for p in pieces])
    total = input_ids.numel()
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    # numpy's repeat: torch.repeat_interleave runs multi-threaded and stalls for milliseconds on a
    # busy CPU, every batch
    starts = torch.from_numpy(np.repeat(cu_seqlens[:-1].numpy(), lengths.numpy()))
    position_ids = torch.arange(total, dtype=torch.long) - starts
    labels = torch.empty_like(input_ids)
    labels[:-1] = input_ids[1:]
    labels[cu_seqlens[1:] - 1] = IGNORE_INDEX
    return PackedBatch(input_ids.unsqueeze(0), labels.unsqueeze(0), position_ids.unsqueeze(0),
                       cu_seqlens)


def document_stream(num_docs: int, seed: int, epochs: int | None = None) -> Iterator[int]:
    """Document indices, a fresh seeded permutation per epoch; endless when epochs is None."""
    generator = torch.Generator().manual_seed(int(seed))
    for _ in (itertools.count() if epochs is None else range(epochs)):
        yield from torch.randperm(num_docs, generator=generator).tolist()


def packed_batches(documents: Sequence[DocumentLike], seq_len: int, batch_size: int, seed: int = 0,
                   *, epochs: int | None = None, drop_last: bool = True) -> Iterator[PackedBatch]:
    """Yield PackedBatch of `batch_size` rows x `seq_len` tokens from shuffled, streamed documents.

    epochs=None streams forever (a new shuffle each epoch). With a finite number of epochs the
    stream ends when the documents run out; the last, incomplete batch is dropped when drop_last,
    else yielded with fewer tokens (its last row shorter than seq_len).
    The same documents, sizes and seed always give the same batches: those of
    `stream.TokenBatches` on one data-parallel replica, which this wraps.
    """
    from .stream import TokenBatches  # the stream is built on this module: imported when called

    if seq_len <= 0 or batch_size <= 0:
        raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
    docs = Documents.from_sequences(documents)
    if len(docs) == 0:
        raise ValueError("packed_batches got no non-empty documents")
    return TokenBatches(docs, seq_len, batch_size, seed=seed, epochs=epochs, drop_last=drop_last)


def random_packed_row(cu_seqlens: Sequence[int], vocab_size: int, seed: int) -> PackedBatch:
    """Synthetic packed row with the given document boundaries and uniform random tokens (for
    verification scripts, benchmarks and tests)."""
    from ..ops.rope import positions_from_cu_seqlens

    gen = torch.Generator().manual_seed(seed)
    total = int(cu_seqlens[-1])
    ids = torch.randint(0, vocab_size, (1, total), generator=gen)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        labels[0, s:e - 1] = ids[0, s + 1:e]
    cu = torch.tensor(list(cu_seqlens), dtype=torch.long)
    return PackedBatch(ids, labels, positions_from_cu_seqlens(cu, total).unsqueeze(0), cu)
