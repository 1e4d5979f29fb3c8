"""What `data.source` holds, ready for the batch stream, and the start-up vocabulary check.

    dataset = load_dataset(config.data)        # train / val Documents (bytes or a prepared dataset)
    check_vocabulary(config.data, config.model.vocab_size)   # reads metadata only

A prepared dataset's documents are split into train and validation by a hash of their index (its
documents have no names; the index is fixed by the sorted inputs of tools/prepare_data.py), with
the rule of the byte corpora: one document at least is held out when data.val_fraction > 0 and
there are two, and training is never empty.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..config import BYTE_VOCAB_SIZE, ConfigError
from .corpus import load_corpus, validation_mask
from .documents import Documents
from .prepared import describe_tokenizer, is_prepared_dir, open_prepared, read_metadata


@dataclass
class Dataset:
    source: str
    kind: str              # "bytes" (stdlib, text files) or "prepared" (tools/prepare_data.py)
    train: Documents
    val: Documents
    max_token_id: int
    tokenizer: str         # what made the ids: "bytes" or the tokenizer file and its hash
    note: str = ""         # e.g. binary files skipped

    def describe(self) -> str:
        note = f", {self.note}" if self.note else ""
        made_by = self.kind if self.tokenizer == self.kind else f"{self.kind}, {self.tokenizer}"
        return (f"{self.source} ({made_by}): {len(self.train):,} train docs "
                f"({self.train.num_tokens:,} tokens), {len(self.val):,} val docs "
                f"({self.val.num_tokens:,} tokens){note}")


def load_dataset(data_config) -> Dataset:
    """Read `data.source`: 'stdlib', text files (bytes) or a prepared dataset (a memory map).
    Raises ConfigError naming data.source when it is missing, empty or corrupt."""
    data_config.validate()
    if is_prepared_dir(data_config.source):
        return _load_prepared(data_config)
    corpus = load_corpus(data_config)
    note = f"{corpus.binary_skipped:,} binary file(s) skipped" if corpus.binary_skipped else ""
    return Dataset(source=corpus.source, kind="bytes", train=Documents.from_sequences(corpus.train),
                   val=Documents.from_sequences(corpus.val), max_token_id=BYTE_VOCAB_SIZE - 1,
                   tokenizer="bytes", note=note)


def _load_prepared(data_config) -> Dataset:
    prepared = open_prepared(data_config.source)
    documents = Documents.from_offsets(prepared.tokens, prepared.offsets)
    if len(documents) == 0:
        raise ConfigError(f"data.source={data_config.source!r} is a prepared dataset without documents; "
                          f"prepare it from inputs that hold text")
    is_val = validation_mask(index_scores(len(documents)), float(data_config.val_fraction))
    return Dataset(source=data_config.source, kind="prepared",
                   train=documents.subset(np.flatnonzero(~is_val)),
                   val=documents.subset(np.flatnonzero(is_val)), max_token_id=prepared.max_token_id,
                   tokenizer=prepared.tokenizer_name())


def index_scores(count: int) -> np.ndarray:
    """A number in [0, 1) per document index (splitmix64 of the index): the split of a prepared
    dataset, vectorised so that millions of documents split in milliseconds."""
    x = np.arange(count, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(2 ** 53)


def data_max_token_id(data_config) -> Tuple[int, str]:
    """The largest token id `data.source` can hold, and where that comes from (no token is read)."""
    source = data_config.source
    if is_prepared_dir(source):
        metadata = read_metadata(source)
        return metadata["max_token_id"], (f"the largest token id of data.source={source!r} is "
                                          f"{metadata['max_token_id']} (tokenizer "
                                          f"{describe_tokenizer(metadata.get('tokenizer', {}))}, "
                                          f"vocabulary {metadata['vocab_size']:,})")
    return BYTE_VOCAB_SIZE - 1, (f"data.source={source!r} is read as bytes, whose largest token id is "
                                 f"{BYTE_VOCAB_SIZE - 1}")


def check_vocabulary(data_config, vocab_size: int) -> None:
    """Raise ConfigError naming model.vocab_size when the data holds an id >= vocab_size."""
    max_token_id, where = data_max_token_id(data_config)
    if vocab_size <= max_token_id:
        raise ConfigError(f"model.vocab_size={vocab_size} is too small: {where}; set model.vocab_size >= "
                          f"{max_token_id + 1}")
