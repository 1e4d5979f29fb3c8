"""Several sources read by weight (`data.blend`): the blend's documents and the order of its epochs.

Source s (of `data.blend = [[w_0, source_0], [w_1, source_1], ...]`) gets the share
p_s = w_s / sum(w) of the tokens. A blend epoch holds E tokens, as many as all sources together (one
pass over each at its natural share); source s's quota Q_s is p_s * E rounded to whole tokens, the
quotas summing to E (largest remainders, ties to the source listed first).

**Which tokens.** Each source has its own endless stream: every document once per source epoch, in a
permutation drawn from a seed made of data.seed and s (s = 0: data.seed itself, so a blend of one
source is that source's stream). Blend epoch e takes tokens [e * Q_s, (e + 1) * Q_s) of source s's
stream: a source above its natural share is read more than once per blend epoch, one below goes on
in the next blend epoch where this one stopped (every document is read before any is read again). A
document cut by the end of a quota goes on at the start of its source's share of the next blend epoch,
as a document cut by the end of a row goes on in the next row.

**In what order.** Within a blend epoch the sources' pieces are interleaved by progress: a piece that
starts after t tokens of its source's quota has the key t / Q_s, and the pieces go in the order of
their keys (equal keys: the source listed first; a source's own pieces keep their order). So at every
point of the stream all sources have read the same fraction of their quota, each to within one of its
pieces: source s's tokens so far differ from p_s times all tokens so far by less than p_s times one
document of every other source (with two sources, under one document), plus under one token per blend
epoch from the rounding of the quotas; at the end of each blend epoch source s has read exactly Q_s.

The order depends on the sources, the weights and the seed alone, and a stream position is (blend
epoch, tokens into it) by a division: the stream of data/stream.py resumes anywhere exactly.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .documents import Documents
from .epochs import EpochOrder, EpochStream, ShuffledEpochs

_SEED_STEP = 0x9E3779B97F4A7C15   # the golden-ratio increment: sources' seeds far apart


def source_seed(seed: int, source: int) -> int:
    """The seed of source `source`'s own stream (source 0: `seed` itself)."""
    return seed if source == 0 else (seed + source * _SEED_STEP) % 2 ** 64


def blend_quotas(weights: Sequence[float], tokens_per_epoch: int) -> np.ndarray:
    """Each source's tokens per blend epoch: weight / sum(weights) of `tokens_per_epoch`, whole tokens
    summing to it (largest remainders). Raises ValueError when a share rounds to no token."""
    shares = np.asarray(weights, dtype=np.float64) / math.fsum(weights)
    exact = shares * tokens_per_epoch
    quotas = np.floor(exact).astype(np.int64)
    missing = tokens_per_epoch - int(quotas.sum())   # below the number of sources; < 0 only by rounding
    if missing >= 0:
        quotas[np.argsort(-(exact - quotas), kind="stable")[:missing]] += 1
    else:
        quotas[np.argsort(exact - quotas, kind="stable")[:-missing]] -= 1
    for index, quota in enumerate(quotas.tolist()):
        if quota == 0:
            raise ValueError(f"source {index}'s share {shares[index]:.3g} of a blend epoch of "
                             f"{tokens_per_epoch:,} tokens rounds to no token")
    return quotas


class BlendedDocuments:
    """The documents of several sources as one collection (source after source), read by weight.
    It serves the stream as a Documents does: len, num_tokens (a blend epoch), piece, document."""

    def __init__(self, sources: Sequence[Documents], weights: Sequence[float]):
        if not sources or len(sources) != len(weights):
            raise ValueError(f"a blend needs one weight per source, got {len(weights)} weights for "
                             f"{len(sources)} sources")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"blend weights must be finite numbers > 0, got {list(weights)}")
        empty = [index for index, documents in enumerate(sources) if len(documents) == 0]
        if empty:
            raise ValueError(f"blend source(s) {empty} hold no documents")
        self.sources = tuple(sources)
        self.weights = tuple(float(w) for w in weights)
        self.first_documents = np.cumsum([0] + [len(documents) for documents in sources])
        self.num_tokens = sum(documents.num_tokens for documents in sources)
        self.quotas = blend_quotas(self.weights, self.num_tokens)

    def __len__(self) -> int:
        return int(self.first_documents[-1])

    def source_of(self, index: int) -> int:
        return int(np.searchsorted(self.first_documents, index, side="right")) - 1

    def piece(self, index: int, begin: int, end: int) -> torch.Tensor:
        source = self.source_of(index)
        return self.sources[source].piece(index - int(self.first_documents[source]), begin, end)

    def document(self, index: int) -> torch.Tensor:
        source = self.source_of(index)
        return self.sources[source].document(index - int(self.first_documents[source]))

    def identity(self) -> list[list[int]]:
        """What fixes the blend's stream besides the seed: each source's quota, documents, tokens."""
        return [[int(quota), len(documents), documents.num_tokens]
                for quota, documents in zip(self.quotas, self.sources)]

    def epochs(self, seed: int) -> BlendedEpochs:
        return BlendedEpochs(self, seed)


class BlendedEpochs(EpochStream):
    """Blend epoch e: each source's quota of its own stream, interleaved by progress (module docstring)."""

    def __init__(self, blend: BlendedDocuments, seed: int):
        self.blend = blend
        self.tokens_per_epoch = blend.num_tokens
        self.source_streams = [ShuffledEpochs(documents.lengths, source_seed(int(seed), index))
                               for index, documents in enumerate(blend.sources)]
        self._cache: dict[int, EpochOrder] = {}

    def epoch(self, epoch: int) -> EpochOrder:
        if epoch not in self._cache:
            documents, begins, sizes, keys = [], [], [], []
            for index, (stream, quota) in enumerate(zip(self.source_streams, self.blend.quotas.tolist())):
                pieces = stream.span(epoch * quota, (epoch + 1) * quota)
                size = pieces.ends - pieces.begins
                keys.append((np.cumsum(size) - size) / quota)   # the quota's fraction read before each piece
                documents.append(pieces.documents + self.blend.first_documents[index])
                begins.append(pieces.begins)
                sizes.append(size)
            order = np.argsort(np.concatenate(keys), kind="stable")
            self._cache = {e: v for e, v in self._cache.items() if e == epoch - 1}
            self._cache[epoch] = EpochOrder(np.concatenate(documents)[order], np.concatenate(begins)[order],
                                            np.cumsum(np.concatenate(sizes)[order]))
        return self._cache[epoch]
