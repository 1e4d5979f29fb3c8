"""Data: byte-level corpora (no download) and packing into fixed-size varlen batches."""
from gdn_parallel.data.corpus import BYTE_VOCAB_SIZE, Corpus, load_corpus
from gdn_parallel.data.packing import IGNORE_INDEX, PackedBatch, num_label_tokens, packed_batches

__all__ = ["BYTE_VOCAB_SIZE", "Corpus", "load_corpus", "IGNORE_INDEX", "PackedBatch",
           "num_label_tokens", "packed_batches"]
