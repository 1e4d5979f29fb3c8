"""Data: byte corpora (no download), prepared token datasets (prepare.py, gdn-prepare-data), Megatron-LM
indexed datasets, weighted blends of sources, and the deterministic, resumable, data-parallel stream
of packed batches (cu_seqlens).

The names below are imported when first used (PEP 562): `gdn-prepare-data` imports
gdn_parallel.data.prepare, which needs no torch, and this package's own import would otherwise cost it
the 1.5 s of importing torch."""
from importlib import import_module

_HOMES = {"BlendedDocuments": "blend", "BYTE_VOCAB_SIZE": "corpus", "Corpus": "corpus",
          "load_corpus": "corpus", "Dataset": "dataset", "check_vocabulary": "dataset",
          "load_dataset": "dataset", "Documents": "documents", "IGNORE_INDEX": "packing",
          "PackedBatch": "packing", "num_label_tokens": "packing", "packed_batches": "packing",
          "TokenBatches": "stream"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value          # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
