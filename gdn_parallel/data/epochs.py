"""The order of the global token stream: which document pieces fill each epoch, in what order.

An epoch order is a list of pieces (document, first token) with their cumulative token ends; the
stream (data/stream.py) reads tokens [start, stop) of the endless sequence of epochs through `span`.
`ShuffledEpochs` is the order of one collection of documents: epoch e is every document once, whole,
in the e-th `torch.randperm` of a generator seeded with the seed. data/blend.py builds a blend's
epochs from its sources' ShuffledEpochs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class EpochOrder:
    documents: np.ndarray          # int64: the document of each piece, in stream order
    begins: np.ndarray | None   # int64: where each piece starts in its document; None: all at 0
    ends: np.ndarray               # int64: cumulative token end of each piece within the epoch


@dataclass(frozen=True)
class Pieces:
    documents: np.ndarray          # int64
    begins: np.ndarray             # int64: first token of the piece in its document
    ends: np.ndarray               # int64: one past its last token

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.documents.tolist(), self.begins.tolist(), self.ends.tolist())


class EpochStream(ABC):
    """Endless epochs of `tokens_per_epoch` tokens each; subclasses give `epoch(e)`."""
    tokens_per_epoch: int

    @abstractmethod
    def epoch(self, epoch: int) -> EpochOrder:
        """The pieces of epoch `epoch`, in stream order."""

    def span(self, start: int, stop: int) -> Pieces:
        """The pieces covering stream tokens [start, stop), in stream order (vectorised per epoch)."""
        parts = []
        while start < stop:
            epoch, offset = divmod(start, self.tokens_per_epoch)
            last = min(offset + stop - start, self.tokens_per_epoch)
            order = self.epoch(epoch)
            low = int(np.searchsorted(order.ends, offset, side="right"))
            high = int(np.searchsorted(order.ends, last - 1, side="right")) + 1
            ends = order.ends[low:high]
            starts = np.empty_like(ends)
            starts[0] = order.ends[low - 1] if low else 0
            starts[1:] = ends[:-1]
            taken_from, taken_to = np.maximum(starts, offset), np.minimum(ends, last)
            begins = taken_from - starts
            if order.begins is not None:
                begins += order.begins[low:high]
            parts.append((order.documents[low:high], begins, begins + (taken_to - taken_from)))
            start += last - offset
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Pieces(empty, empty, empty)
        return Pieces(*(np.concatenate(column) for column in zip(*parts)))


class ShuffledEpochs(EpochStream):
    """Epoch e: every document once, whole, in the e-th permutation drawn from `seed` (the order of
    `packing.document_stream`)."""

    def __init__(self, lengths: np.ndarray, seed: int):
        self.lengths = lengths
        self.seed = int(seed)
        self.tokens_per_epoch = int(lengths.sum())
        self._generator = torch.Generator().manual_seed(self.seed)
        self._generated = 0        # permutations drawn from the generator so far
        self._cache: dict[int, EpochOrder] = {}

    def epoch(self, epoch: int) -> EpochOrder:
        """Two epochs are kept: a read straddles at most one boundary, and a blend reads on in order."""
        if epoch not in self._cache:
            if epoch < self._generated:   # behind the generator (after a restore): replay from the seed
                self._generator.manual_seed(self.seed)
                self._generated = 0
            while self._generated <= epoch:
                order = torch.randperm(self.lengths.shape[0], generator=self._generator).numpy()
                self._generated += 1
            self._cache = {e: v for e, v in self._cache.items() if e == epoch - 1}
            self._cache[epoch] = EpochOrder(order, None, np.cumsum(self.lengths[order]))
        return self._cache[epoch]
