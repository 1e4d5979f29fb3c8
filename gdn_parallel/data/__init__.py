"""Data: byte corpora (no download), prepared token datasets (prepare.py, gdn-prepare-data), Megatron-LM
indexed datasets, weighted blends of sources, and the deterministic, resumable, data-parallel stream
of packed batches (cu_seqlens)."""
from gdn_parallel.data.blend import BlendedDocuments
from gdn_parallel.data.corpus import BYTE_VOCAB_SIZE, Corpus, load_corpus
from gdn_parallel.data.dataset import Dataset, check_vocabulary, load_dataset
from gdn_parallel.data.documents import Documents
from gdn_parallel.data.packing import IGNORE_INDEX, PackedBatch, num_label_tokens, packed_batches
from gdn_parallel.data.stream import TokenBatches

__all__ = ["BYTE_VOCAB_SIZE", "BlendedDocuments", "Corpus", "load_corpus", "Dataset", "check_vocabulary",
           "load_dataset", "Documents", "IGNORE_INDEX", "PackedBatch", "num_label_tokens", "packed_batches",
           "TokenBatches"]
