"""What `data.source` (or `data.blend`) holds, ready for the batch stream, and the start-up vocabulary check.

    dataset = load_dataset(config.data)        # train / val Documents (bytes, prepared, Megatron, a blend)
    check_vocabulary(config.data, config.model.vocab_size)   # reads metadata (Megatron: the .bin, once)

The kinds of `data.source`, in the order they are recognised: 'stdlib' (bytes), a directory written
by gdn-prepare-data ("prepared"), a Megatron-LM indexed dataset prefix ("megatron",
data/megatron_indexed.py), else text files (bytes). A prepared or Megatron dataset's documents are
split into train and validation by a hash of their index (its documents have no names; the index is
fixed by the dataset), with the rule of the byte corpora: one document at least is held out when
data.val_fraction > 0 and there are two, and training is never empty.

`data.blend` loads each source as data.source would (the same val_fraction, text_suffixes), trains
on the blend of their training splits (data/blend.py) and validates on the blend of their validation
splits with the same weights (a source without validation documents is left out of it, and said).
Sources whose ids come from different tokenizers are refused: an id would mean two tokens (a Megatron
dataset records no tokenizer and is not compared).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..config import BYTE_VOCAB_SIZE, ConfigError
from .blend import BlendedDocuments
from .corpus import load_corpus, validation_mask
from .documents import Documents
from .megatron_indexed import largest_token_id, megatron_prefix, open_megatron
from .prepared import describe_tokenizer, is_prepared_dir, open_prepared, read_metadata
from .tokenizer_record import one_byte_per_token

MEGATRON_TOKENIZER = "tokenizer not recorded"   # a Megatron index does not say what made its ids


@dataclass
class Dataset:
    source: str
    kind: str              # "bytes" (stdlib, text files), "prepared", "megatron" or "blend"
    train: Documents | BlendedDocuments
    val: Documents | BlendedDocuments
    max_token_id: int
    tokenizer: str         # what made the ids: "bytes" or the tokenizer file and its hash
    note: str = ""         # e.g. binary files skipped
    parts: tuple[Dataset, ...] = ()   # a blend's sources, in data.blend's order
    # per val token, the UTF-8 bytes of the text it stands for (documents like `val`); None: unknown
    val_token_bytes: Documents | BlendedDocuments | None = None

    def describe(self) -> str:
        note = f", {self.note}" if self.note else ""
        if self.kind == "blend":
            blend = self.train
            if not isinstance(blend, BlendedDocuments):
                raise TypeError(f"a blend's train documents are BlendedDocuments, got {type(blend).__name__}")
            return "blend of " + "; ".join(_describe_part(blend, index, part)
                                           for index, part in enumerate(self.parts)) + note
        made_by = self.kind if self.tokenizer == self.kind else f"{self.kind}, {self.tokenizer}"
        return (f"{self.source} ({made_by}): {len(self.train):,} train docs "
                f"({self.train.num_tokens:,} tokens), {len(self.val):,} val docs "
                f"({self.val.num_tokens:,} tokens){note}")


def _describe_part(blend: BlendedDocuments, index: int, part: Dataset) -> str:
    share, quota = blend.weights[index] / sum(blend.weights), int(blend.quotas[index])
    return (f"{share:.1%} {part.describe()}, read {quota / part.train.num_tokens:.2f}x per blend epoch "
            f"of {blend.num_tokens:,} tokens")


def data_field(data_config) -> str:
    """The field that names the data, with its value (for messages)."""
    return f"data.blend={data_config.blend!r}" if data_config.blend else f"data.source={data_config.source!r}"


def load_dataset(data_config) -> Dataset:
    """Read `data.source` ('stdlib', text files, a prepared or a Megatron dataset: memory maps) or
    `data.blend`. Raises ConfigError naming the field when a source is missing, empty or corrupt."""
    data_config.validate()
    if data_config.blend:
        return _load_blend(data_config)
    return _load_source(data_config)


def _load_source(data_config) -> Dataset:
    if is_prepared_dir(data_config.source):
        return _load_prepared(data_config)
    if megatron_prefix(data_config.source):
        return _load_megatron(data_config)
    corpus = load_corpus(data_config)
    note = f"{corpus.binary_skipped:,} binary file(s) skipped" if corpus.binary_skipped else ""
    val = Documents.from_sequences(corpus.val)
    return Dataset(source=corpus.source, kind="bytes", train=Documents.from_sequences(corpus.train),
                   val=val, max_token_id=BYTE_VOCAB_SIZE - 1, tokenizer="bytes", note=note,
                   val_token_bytes=one_byte_per_token(val))


def _load_prepared(data_config) -> Dataset:
    prepared = open_prepared(data_config.source)
    documents = _indexed_documents(prepared.tokens, prepared.offsets, data_config, "a prepared dataset",
                                   "prepare it from inputs that hold text")
    train, val = _split(documents, data_config)
    val_bytes = (None if prepared.token_bytes is None   # the same documents and split, over the byte counts
                 else _split(Documents.from_offsets(prepared.token_bytes, prepared.offsets), data_config)[1])
    return Dataset(source=data_config.source, kind="prepared", train=train, val=val,
                   max_token_id=prepared.max_token_id, tokenizer=prepared.tokenizer_name(),
                   val_token_bytes=val_bytes)


def _load_megatron(data_config) -> Dataset:
    indexed = open_megatron(data_config.source)
    documents = _indexed_documents(indexed.tokens, indexed.offsets, data_config, "a Megatron indexed dataset",
                                   "give one whose documents hold tokens")
    empty = indexed.num_documents - len(documents)
    train, val = _split(documents, data_config)
    return Dataset(source=data_config.source, kind="megatron", train=train, val=val,
                   max_token_id=largest_token_id(data_config.source, indexed),
                   tokenizer=f"{indexed.dtype_name} ids, {MEGATRON_TOKENIZER}",
                   note=f"{empty:,} empty document(s) left out" if empty else "")


def _indexed_documents(tokens, offsets, data_config, what: str, fix: str) -> Documents:
    """The non-empty documents of a token file with a document index; ConfigError when there are none."""
    documents = Documents.from_offsets(tokens, offsets)
    if len(documents) == 0:
        raise ConfigError(f"data.source={data_config.source!r} is {what} without documents; {fix}")
    return documents


def _split(documents: Documents, data_config) -> tuple[Documents, Documents]:
    is_val = validation_mask(index_scores(len(documents)), float(data_config.val_fraction))
    return documents.subset(np.flatnonzero(~is_val)), documents.subset(np.flatnonzero(is_val))


def _load_blend(data_config) -> Dataset:
    parts: list[Dataset] = []
    for index, (_, source) in enumerate(data_config.blend):
        try:
            parts.append(_load_source(dataclasses.replace(data_config, source=source, blend=[])))
        except ConfigError as err:
            raise ConfigError(f"data.blend[{index}]: {err}") from None
    _check_same_tokenizer(parts)
    weights = [weight for weight, _ in data_config.blend]
    with_val = [index for index, part in enumerate(parts) if len(part.val)]
    try:
        train = BlendedDocuments([_unblended(part.train) for part in parts], weights)
        val = (BlendedDocuments([_unblended(parts[i].val) for i in with_val], [weights[i] for i in with_val])
               if with_val else Documents.from_sequences([]))
    except ValueError as err:
        raise ConfigError(f"data.blend={data_config.blend!r}: {err}; raise that source's weight or leave it "
                          f"out") from None
    without_val = [f"data.blend[{index}]" for index in range(len(parts)) if index not in with_val]
    note = (f"{', '.join(without_val)} without validation documents: validation blends the others"
            if without_val and with_val else "")
    counts = [parts[i].val_token_bytes for i in with_val]
    # The byte counts have the val documents' lengths, so their blend has the same quotas and order.
    val_bytes = (BlendedDocuments([_unblended(c) for c in counts], [weights[i] for i in with_val])
                 if with_val and all(c is not None for c in counts) else None)
    return Dataset(source="blend", kind="blend", train=train, val=val,
                   max_token_id=max(part.max_token_id for part in parts),
                   tokenizer="; ".join(part.tokenizer for part in parts), note=note, parts=tuple(parts),
                   val_token_bytes=val_bytes)


def _unblended(documents: Documents | BlendedDocuments | None) -> Documents:
    """A blend source's documents: each source is one dataset (bytes, prepared, Megatron), never a blend."""
    if not isinstance(documents, Documents):
        raise TypeError(f"a blend source holds Documents, got {type(documents).__name__}")
    return documents


def _check_same_tokenizer(parts: list[Dataset]) -> None:
    known = {index: part.tokenizer for index, part in enumerate(parts) if part.kind != "megatron"}
    if len(set(known.values())) > 1:
        listed = ", ".join(f"data.blend[{index}] by {name}" for index, name in known.items())
        raise ConfigError(f"data.blend mixes ids of different tokenizers ({listed}): one id would mean "
                          f"different tokens; blend sources made by one tokenizer")


def index_scores(count: int) -> np.ndarray:
    """A number in [0, 1) per document index (splitmix64 of the index): the split of a prepared
    dataset, vectorised so that millions of documents split in milliseconds."""
    x = np.arange(count, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(2 ** 53)


def data_max_token_id(data_config) -> tuple[int, str]:
    """The largest token id the data can hold, and where that comes from (only a Megatron dataset's
    tokens are read: its index records no largest id)."""
    if data_config.blend:
        found = []
        for index, (_, source) in enumerate(data_config.blend):
            try:
                largest, where = _source_max_token_id(source)
            except ConfigError as err:
                raise ConfigError(f"data.blend[{index}]: {err}") from None
            found.append((largest, f"data.blend[{index}]: {where}"))
        return max(found, key=lambda item: item[0])
    return _source_max_token_id(data_config.source)


def _source_max_token_id(source: str) -> tuple[int, str]:
    if is_prepared_dir(source):
        metadata = read_metadata(source)
        return metadata["max_token_id"], (f"the largest token id of data.source={source!r} is "
                                          f"{metadata['max_token_id']} (tokenizer "
                                          f"{describe_tokenizer(metadata.get('tokenizer', {}))}, "
                                          f"vocabulary {metadata['vocab_size']:,})")
    if megatron_prefix(source):
        largest = largest_token_id(source, open_megatron(source))
        return largest, (f"the largest token id of data.source={source!r} (a Megatron-LM indexed dataset, "
                         f"{MEGATRON_TOKENIZER}) is {largest}")
    return BYTE_VOCAB_SIZE - 1, (f"data.source={source!r} is read as bytes, whose largest token id is "
                                 f"{BYTE_VOCAB_SIZE - 1}")


def check_vocabulary(data_config, vocab_size: int) -> None:
    """Raise ConfigError naming model.vocab_size when the data holds an id >= vocab_size."""
    max_token_id, where = data_max_token_id(data_config)
    if vocab_size <= max_token_id:
        raise ConfigError(f"model.vocab_size={vocab_size} is too small: {where}; set model.vocab_size >= "
                          f"{max_token_id + 1}")
