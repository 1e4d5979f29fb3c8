"""A deterministic, resumable stream of packed micro-batches, sharded over data-parallel replicas.

**The global token stream.** Epoch e is every document once, in a seeded shuffle (the e-th
`torch.randperm` of a generator seeded with `seed`, as `packing.document_stream` draws them), laid
end to end; the epochs follow each other without a gap. The stream depends on the documents and
the seed alone, not on the parallel layout nor the batch shape.

**Sharding over dp (the rule).** A micro-batch is `rows * seq_len = B` tokens. The stream is cut
into consecutive global micro-batches of `dp_size * B` tokens, and replica r takes tokens
[r * B, (r + 1) * B) of each: its k-th micro-batch is global tokens
[(k * dp_size + r) * B, (k * dp_size + r + 1) * B). Every replica therefore yields the same number
of micro-batches, forever; within an epoch no token is dropped or repeated across replicas, for any
number of replicas and documents (a document longer than a share is split between replicas, and
more replicas than documents is fine). An epoch ends inside a global micro-batch, which takes the
first tokens of the next epoch, as a single process's stream always has. Ranks of one replica (its
cp / tp / pp ranks) build the stream with the same dp_rank and see the same rows.

**Rows.** Each B-token share is cut into `rows` rows of `seq_len` tokens. `packing="documents"`:
every document piece is its own sequence (`cu_seqlens`, labels and positions restart, the last
token of a piece has no label), the behaviour of `packing.packed_batches`, which yields exactly this
stream at dp_size=1. `packing="concatenate"`: each row is one sequence running across document
boundaries (labels cross them; the row's last token has no label). Both take the same tokens.

**State.** `state_dict()` is the stream's place in the global stream (epoch, tokens into it) and
what identifies the stream (seed, document and token counts). All replicas hold the same state, so
any rank's copy restores every rank. `load_state_dict` continues at that place under whatever
layout the new stream has: another dp size, micro-batch shape or packing resumes at the first token
no replica has seen, so nothing is skipped or repeated (only the split of the coming tokens among
replicas changes). A state of other documents or another seed is refused (ConfigError).

A finite stream (`epochs=N`) ends after N epochs; its last global micro-batch is dropped when
`drop_last`, else each replica takes what is left of its share (shorter, or none: then that
replica's stream ends one micro-batch before the others').
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..config import ConfigError, DataConfig
from .dataset import load_dataset
from .documents import Documents
from .packing import PackedBatch, pack_pieces

STATE_VERSION = 1
PACKING_MODES = DataConfig.PACKING_MODES


class TokenBatches:
    """Iterator of PackedBatch micro-batches of `rows` x `seq_len` tokens for one dp replica."""

    def __init__(self, documents: Documents, seq_len: int, rows: int, *, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, packing: str = "documents",
                 epochs: Optional[int] = None, drop_last: bool = True):
        if seq_len <= 0 or rows <= 0:
            raise ValueError(f"seq_len={seq_len} and rows={rows} must be positive")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if packing not in PACKING_MODES:
            raise ValueError(f"packing={packing!r} must be one of {PACKING_MODES}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs={epochs} must be >= 1 or None (endless)")
        if len(documents) == 0:
            raise ValueError("TokenBatches got no non-empty documents")
        self.documents = documents
        self.seq_len, self.rows = int(seq_len), int(rows)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed, self.packing = int(seed), packing
        self.epochs, self.drop_last = epochs, drop_last
        self.tokens_per_epoch = documents.num_tokens
        self.position = 0          # global token where the next global micro-batch starts
        self._generator = torch.Generator().manual_seed(self.seed)
        self._generated = 0        # permutations drawn from the generator so far
        self._epoch_cache: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_config(cls, data_config, seq_len: int, rows: int, *, dp_rank: int = 0, dp_size: int = 1,
                    seed: Optional[int] = None, split: str = "train", dataset=None,
                    epochs: Optional[int] = None, drop_last: bool = True) -> "TokenBatches":
        """The stream of `data.source`'s split ('train' or 'val'), seeded by data.seed unless `seed`
        is given, packed as data.packing says. `dataset`: an already loaded
        gdn_parallel.data.load_dataset(data_config), so that train and val read the source once."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        data_config.validate()
        dataset = dataset if dataset is not None else load_dataset(data_config)
        documents = dataset.train if split == "train" else dataset.val
        if len(documents) == 0:
            raise ConfigError(f"data.source={data_config.source!r} has no {split} documents "
                              f"(data.val_fraction={data_config.val_fraction}); check len(dataset.val) "
                              f"before asking for the validation stream")
        return cls(documents, seq_len, rows, dp_rank=dp_rank, dp_size=dp_size,
                   seed=data_config.seed if seed is None else seed, packing=data_config.packing,
                   epochs=epochs, drop_last=drop_last)

    @property
    def tokens_per_batch(self) -> int:
        return self.rows * self.seq_len

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        share = self.tokens_per_batch
        start = self.position + self.dp_rank * share
        stop = start + share
        if self.epochs is not None:
            end = self.epochs * self.tokens_per_epoch
            if self.position >= end or (self.drop_last and self.position + self.dp_size * share > end):
                raise StopIteration
            stop = min(stop, end)
            if start >= stop:
                raise StopIteration
        self.position += self.dp_size * share
        return self._pack(start, stop)

    def _pack(self, start: int, stop: int) -> PackedBatch:
        pieces: List[torch.Tensor] = []
        for row_start in range(start, stop, self.seq_len):
            row = [self.documents.piece(doc, begin, end)
                   for doc, begin, end in self._segments(row_start, min(row_start + self.seq_len, stop))]
            pieces.extend(row if self.packing == "documents" else [torch.cat(row)])
        return pack_pieces(pieces)

    def _segments(self, start: int, stop: int) -> Iterator[Tuple[int, int, int]]:
        """(document, begin, end) pieces covering global tokens [start, stop), in stream order."""
        lengths = self.documents.lengths
        position = start
        while position < stop:
            epoch, offset = divmod(position, self.tokens_per_epoch)
            order, ends = self._epoch(epoch)
            slot = int(np.searchsorted(ends, offset, side="right"))
            while slot < order.shape[0] and position < stop:
                doc = int(order[slot])
                doc_end = int(ends[slot])
                begin = offset - (doc_end - int(lengths[doc]))
                take = min(doc_end - offset, stop - position)
                yield doc, begin, begin + take
                position += take
                offset += take
                slot += 1

    def _epoch(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """Epoch `epoch`'s document order and the cumulative token ends along it (two epochs are
        kept: a share straddles at most one boundary)."""
        if epoch not in self._epoch_cache:
            if epoch < self._generated:   # behind the generator (after a restore): replay from the seed
                self._generator.manual_seed(self.seed)
                self._generated = 0
            num_docs = len(self.documents)
            while self._generated <= epoch:
                order = torch.randperm(num_docs, generator=self._generator).numpy()
                self._generated += 1
            ends = np.cumsum(self.documents.lengths[order])
            self._epoch_cache = {e: v for e, v in self._epoch_cache.items() if e == epoch - 1}
            self._epoch_cache[epoch] = (order, ends)
        return self._epoch_cache[epoch]

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        epoch, offset = divmod(self.position, self.tokens_per_epoch)
        return {"version": STATE_VERSION, "epoch": epoch, "tokens_into_epoch": offset, "seed": self.seed,
                "documents": len(self.documents), "tokens_per_epoch": self.tokens_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue where the stream that saved `state` stopped (its layout may differ)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"the saved data stream state {state!r} is not a version {STATE_VERSION} "
                              f"TokenBatches state; resume with the gdn_parallel that saved it")
        saved = (state.get("seed"), state.get("documents"), state.get("tokens_per_epoch"))
        here = (self.seed, len(self.documents), self.tokens_per_epoch)
        if saved != here:
            raise ConfigError(
                f"the checkpoint's data stream ran over {saved[1]} documents / {saved[2]} tokens with "
                f"data.seed={saved[0]}; data.source now gives {here[1]} / {here[2]} with data.seed={here[0]}. "
                f"Resume with the same data.source, data.val_fraction and data.seed, or start a new run")
        epoch, offset = int(state["epoch"]), int(state["tokens_into_epoch"])
        if epoch < 0 or not 0 <= offset < self.tokens_per_epoch:
            raise ConfigError(f"the saved data stream state has epoch={epoch}, tokens_into_epoch={offset}, "
                              f"outside the {self.tokens_per_epoch} tokens of an epoch")
        self.position = epoch * self.tokens_per_epoch + offset
