"""Megatron-LM indexed datasets written by megatron-core's own IndexedDatasetBuilder (the tests that
use it skip where megatron-core is not installed: pip install -e ".[megatron]")."""
from collections.abc import Sequence

import numpy as np
import pytest
import torch


def write_megatron(prefix, documents: Sequence[Sequence[Sequence[int]]], dtype=np.int32,
                   multimodal=False) -> str:
    """Write `documents` (each a list of sequences of token ids) at `prefix`; return the prefix."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for sequences in documents:
        for sequence in sequences:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_megatron_documents(count: int, seed: int, high: int = 256,
                              longest: int = 60) -> list[list[list[int]]]:
    """`count` documents of one to three sequences of random ids below `high`."""
    gen = torch.Generator().manual_seed(seed)
    documents = []
    for _ in range(count):
        sequences = int(torch.randint(1, 4, (1,), generator=gen))
        documents.append([torch.randint(0, high, (int(torch.randint(1, longest, (1,), generator=gen)),),
                                        generator=gen).tolist() for _ in range(sequences)])
    return documents


def joined(documents) -> list[list[int]]:
    """Each document's tokens: its sequences back to back (empty documents left out, as we read them)."""
    flat = [[token for sequence in sequences for token in sequence] for sequences in documents]
    return [tokens for tokens in flat if tokens]
