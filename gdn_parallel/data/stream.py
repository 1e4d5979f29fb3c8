"""A deterministic, resumable stream of packed micro-batches, sharded over data-parallel replicas.

**The global token stream.** Epoch e is every document once, in a seeded shuffle (the e-th
`torch.randperm` of a generator seeded with `seed`, as `packing.document_stream` draws them), laid
end to end; the epochs follow each other without a gap. The stream depends on the documents and
the seed alone, not on the parallel layout nor the batch shape. A blend (`BlendedDocuments`,
data.blend) has blend epochs instead: each source's quota of tokens from its own shuffled stream,
interleaved by weight (data/blend.py); everything below holds for it as it is, an epoch meaning a
blend epoch.

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
what identifies the stream (seed, document and token counts; for a blend also each source's quota,
documents and tokens, under "blend"). All replicas hold the same state, so any rank's copy
restores every rank. `load_state_dict` continues at that place under whatever layout the new stream
has: another dp size, micro-batch shape or packing resumes at the first token
no replica has seen, so nothing is skipped or repeated (only the split of the coming tokens among
replicas changes). A blend resumes mid-epoch in the same place of its interleaving, since the
position alone fixes it. A state of other documents, another blend or another seed is refused
(ConfigError).

A finite stream (`epochs=N`) ends after N epochs; its last global micro-batch is dropped when
`drop_last`, else each replica takes what is left of its share (shorter, or none: then that
replica's stream ends one micro-batch before the others').
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..config import ConfigError, DataConfig
from .blend import BlendedDocuments
from .dataset import data_field, load_dataset
from .documents import Documents
from .epochs import ShuffledEpochs
from .packing import PackedBatch, pack_pieces

STATE_VERSION = 1
PACKING_MODES = DataConfig.PACKING_MODES


class TokenBatches:
    """Iterator of PackedBatch micro-batches of `rows` x `seq_len` tokens for one dp replica."""

    def __init__(self, documents: Documents | BlendedDocuments, seq_len: int, rows: int, *,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, packing: str = "documents",
                 epochs: int | None = None, drop_last: bool = True):
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
        self._order = (documents.epochs(self.seed) if isinstance(documents, BlendedDocuments)
                       else ShuffledEpochs(documents.lengths, self.seed))

    @classmethod
    def from_config(cls, data_config, seq_len: int, rows: int, *, dp_rank: int = 0, dp_size: int = 1,
                    seed: int | None = None, split: str = "train", dataset=None,
                    epochs: int | None = None, drop_last: bool = True) -> TokenBatches:
        """The stream of `data.source`'s (or `data.blend`'s) split ('train' or 'val'), seeded by
        data.seed unless `seed` is given, packed as data.packing says. `dataset`: an already loaded
        gdn_parallel.data.load_dataset(data_config), so that train and val read the source once."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        data_config.validate()
        dataset = dataset if dataset is not None else load_dataset(data_config)
        documents = dataset.train if split == "train" else dataset.val
        if len(documents) == 0:
            raise ConfigError(f"{data_field(data_config)} has no {split} documents "
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
        pieces: list[torch.Tensor] = []
        for row_start in range(start, stop, self.seq_len):
            row = [self.documents.piece(doc, begin, end)
                   for doc, begin, end in self._order.span(row_start, min(row_start + self.seq_len, stop))]
            pieces.extend(row if self.packing == "documents" else [torch.cat(row)])
        return pack_pieces(pieces)

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        epoch, offset = divmod(self.position, self.tokens_per_epoch)
        state: dict[str, Any] = {"version": STATE_VERSION, "epoch": epoch, "tokens_into_epoch": offset,
                                 "seed": self.seed, "documents": len(self.documents),
                                 "tokens_per_epoch": self.tokens_per_epoch}
        if isinstance(self.documents, BlendedDocuments):
            state["blend"] = self.documents.identity()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue where the stream that saved `state` stopped (its layout may differ)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"the saved data stream state {state!r} is not a version {STATE_VERSION} "
                              f"TokenBatches state; resume with the gdn_parallel that saved it")
        saved = (state.get("seed"), state.get("documents"), state.get("tokens_per_epoch"), state.get("blend"))
        here = (self.seed, len(self.documents), self.tokens_per_epoch, self.state_dict().get("blend"))
        if saved != here:
            blends = (f" (blend sources as [quota, documents, tokens]: saved {saved[3]}, now {here[3]})"
                      if saved[3] != here[3] else "")
            raise ConfigError(
                f"the checkpoint's data stream ran over {saved[1]} documents / {saved[2]} tokens with "
                f"data.seed={saved[0]}; the data now gives {here[1]} / {here[2]} with data.seed={here[0]}"
                f"{blends}. Resume with the same data.source or data.blend, data.val_fraction and data.seed, "
                f"or start a new run")
        epoch, offset = int(state["epoch"]), int(state["tokens_into_epoch"])
        if epoch < 0 or not 0 <= offset < self.tokens_per_epoch:
            raise ConfigError(f"the saved data stream state has epoch={epoch}, tokens_into_epoch={offset}, "
                              f"outside the {self.tokens_per_epoch} tokens of an epoch")
        self.position = epoch * self.tokens_per_epoch + offset
