"""Packed test rows with documents (labels = next token inside each document)."""
from gdn_parallel.data.packing import random_packed_row
from tests.seeds import seeded


def make_batch(cu, seed, vocab=64):
    return random_packed_row(cu, vocab, seeded(seed))
