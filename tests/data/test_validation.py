"""The validation set is one fixed set of rows under every layout (data/validation.py): the same
labelled tokens and labels whatever the data-parallel size, micro-batch shape or packing, every
replica running the same number of forwards of one shape."""
import itertools

import pytest
import torch

from gdn_parallel.config import IGNORE_INDEX
from gdn_parallel.data import Documents, TokenBatches
from gdn_parallel.data.validation import validation_set

SEQ_LEN = 16


def documents(seed: int, count: int = 12) -> Documents:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    return Documents.from_sequences([torch.randint(0, 256, (n,), generator=generator) for n in lengths])


def labelled(docs: Documents, rows: int, dp: int, rows_per_micro_batch: int, micro_batches: int,
             packing: str) -> list:
    """Every (input token, label) pair with a label, over all replicas, sorted; checks the shapes."""
    pairs, shapes, steps = [], set(), set()
    for rank in range(dp):
        found = validation_set(docs, SEQ_LEN, rows, rows_per_micro_batch=rows_per_micro_batch,
                               micro_batches=micro_batches, dp_rank=rank, dp_size=dp, packing=packing)
        steps.add(len(found.steps))
        for batch in itertools.chain.from_iterable(found.steps):
            shapes.add(tuple(batch.input_ids.shape))
            keep = batch.labels != IGNORE_INDEX
            pairs += list(zip(batch.input_ids[keep].tolist(), batch.labels[keep].tolist()))
    assert len(steps) == 1 and shapes == {(1, rows_per_micro_batch * SEQ_LEN)}  # every replica alike
    return sorted(pairs)


@pytest.mark.parametrize("packing", ["documents", "concatenate"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_the_same_labelled_tokens_under_every_layout(packing, rows):
    docs = documents(seed=rows)
    one = labelled(docs, rows, dp=1, rows_per_micro_batch=rows, micro_batches=1, packing=packing)
    assert one   # the set is not empty, and every other layout must find exactly it
    for dp, per_micro_batch, micro_batches in [(1, 1, 1), (2, 1, 2), (3, 2, 1), (4, 1, 3), (2, 3, 2)]:
        assert labelled(docs, rows, dp, per_micro_batch, micro_batches, packing) == one, (dp, per_micro_batch)


def test_the_rows_are_the_first_rows_of_the_split_and_a_small_split_is_taken_whole():
    docs = documents(seed=0)
    found = validation_set(docs, SEQ_LEN, 2, rows_per_micro_batch=2, micro_batches=1)
    assert (found.rows, found.tokens, found.capped) == (2, 2 * SEQ_LEN, False)
    whole = validation_set(docs, SEQ_LEN, 1000, rows_per_micro_batch=2, micro_batches=1)
    assert whole.capped and whole.tokens == docs.num_tokens == whole.split_tokens
    assert whole.rows == -(-docs.num_tokens // SEQ_LEN)
    # taken whole, the set labels what one pass over the split labels: each piece's tokens but its last
    one_epoch = TokenBatches(docs, SEQ_LEN, 2, seed=0, epochs=1, drop_last=False)
    expected = sorted(pair for b in one_epoch for pair in zip(b.input_ids[b.labels != IGNORE_INDEX].tolist(),
                                                               b.labels[b.labels != IGNORE_INDEX].tolist()))
    assert labelled(docs, 1000, dp=1, rows_per_micro_batch=2, micro_batches=1,
                    packing="documents") == expected
