"""TokenBatches: the batches of the old packed_batches at dp=1, exact resumption, data-parallel
sharding (no token dropped or repeated, equal batch counts), dp changes on resume, packing modes."""
import json
import math

import pytest
import torch

from gdn_parallel.config import ConfigError, DataConfig
from gdn_parallel.data import Documents, TokenBatches, load_dataset, packed_batches
from gdn_parallel.data.packing import IGNORE_INDEX, document_stream, pack_pieces
from tests.seeds import generator, seeded
from tests.train.test_data import check_batch

FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens")


def random_documents(count=23, seed=0, max_len=300):
    gen = generator(seed)
    lengths = torch.randint(1, max_len, (count,), generator=gen).tolist()
    lengths[1] = 1                  # a one-token document
    lengths[2] = 5 * max_len        # longer than a row and than a batch
    return [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in lengths]


def reference_packed_batches(documents, seq_len, batch_size, seed, epochs=None, drop_last=True):
    """packed_batches as it was before the stream existed (the expectation for dp_size=1)."""
    docs = [d for d in documents if d.numel() > 0]
    order = document_stream(len(docs), seed, epochs)
    current, offset, exhausted = None, 0, False
    while not exhausted:
        pieces = []
        for _ in range(batch_size):
            room = seq_len
            while room > 0:
                if current is None or offset == current.numel():
                    index = next(order, None)
                    if index is None:
                        exhausted = True
                        break
                    current, offset = docs[index], 0
                take = min(room, current.numel() - offset)
                pieces.append(current[offset:offset + take])
                offset += take
                room -= take
            if exhausted:
                break
        if exhausted and (drop_last or not pieces):
            return
        yield pack_pieces(pieces)


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, name), getattr(b, name)) for name in FIELDS)


def epoch_stream(documents, seed, epochs=1):
    """The global token stream: every document once per epoch, in the seeded shuffled order."""
    return torch.cat([documents[i].long() for i in document_stream(len(documents), seed, epochs)])


def stream(documents, seq_len=37, rows=3, **kwargs):
    return TokenBatches(Documents.from_sequences(documents), seq_len, rows, **kwargs)


@pytest.mark.parametrize("seq_len,rows,epochs,drop_last", [
    (64, 4, None, True), (17, 3, 2, False), (1000, 1, 3, True), (5, 2, 1, False)])
def test_dp1_stream_is_the_old_packed_batches(seq_len, rows, epochs, drop_last):
    documents, seed = random_documents(), seeded(5)
    new = packed_batches(documents, seq_len, rows, seed=seed, epochs=epochs, drop_last=drop_last)
    old = reference_packed_batches(documents, seq_len, rows, seed, epochs, drop_last)
    limit = 400 if epochs is None else None
    count = 0
    for a, b in zip(old, new):
        assert same(a, b), f"batch {count}"
        count += 1
        if count == limit:
            break
    if limit is None:   # a finite stream ends where the old one did
        assert next(old, None) is None and next(new, None) is None
    assert count > 3


def test_stdlib_default_batches_are_unchanged():
    """The default source and seed give the batches they gave before (first batches checked)."""
    from gdn_parallel.data import load_corpus
    corpus = load_corpus(DataConfig())
    old = reference_packed_batches(corpus.train, 256, 4, 0)
    new = TokenBatches.from_config(DataConfig(), 256, 4)
    for _ in range(50):
        assert same(next(old), next(new))


@pytest.mark.parametrize("packing", ["documents", "concatenate"])
def test_resume_from_state_is_exact_across_epochs(packing):
    documents = random_documents(count=7, max_len=60)   # small: many epochs go by
    args = dict(seq_len=23, rows=2, seed=seeded(3), packing=packing)
    reference = stream(documents, **args)
    batches = [next(reference) for _ in range(120)]
    assert reference.state_dict()["epoch"] >= 4
    for cut in (0, 1, 17, 59, 100):
        walked = stream(documents, **args)
        for _ in range(cut):
            next(walked)
        state = json.loads(json.dumps(walked.state_dict()))   # what a checkpoint keeps
        assert set(state) == {"version", "epoch", "tokens_into_epoch", "seed", "documents",
                              "tokens_per_epoch"}
        resumed = stream(documents, **args)
        resumed.load_state_dict(state)
        for index in range(cut, cut + 15):
            assert same(next(resumed), batches[index]), f"cut {cut}, batch {index}"
    # a stream that has run ahead (its generator past the saved epoch) goes back exactly
    ahead = stream(documents, **args)
    for _ in range(110):
        next(ahead)
    ahead.load_state_dict(json.loads(json.dumps(_state_after(documents, args, 30))))
    assert all(same(next(ahead), batches[i]) for i in range(30, 40))


def _state_after(documents, args, count):
    walked = stream(documents, **args)
    for _ in range(count):
        next(walked)
    return walked.state_dict()


def replica_tokens(documents, dp_size, seq_len, rows, seed, **kwargs):
    """Each replica's batches of an epoch (epochs=1, nothing dropped)."""
    return [list(stream(documents, seq_len, rows, dp_rank=r, dp_size=dp_size, seed=seed, epochs=1,
                        drop_last=False, **kwargs)) for r in range(dp_size)]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 5, 30])
def test_dp_shards_cover_an_epoch_exactly_once(dp_size):
    documents, seed, seq_len, rows = random_documents(count=23), seeded(1), 29, 2
    replicas = replica_tokens(documents, dp_size, seq_len, rows, seed)
    expected = epoch_stream(documents, seed)
    # global order: micro-batch k of replica 0, 1, ..., then k + 1
    interleaved = [replicas[r][k] for k in range(max(map(len, replicas))) for r in range(dp_size)
                   if k < len(replicas[r])]
    assert torch.equal(torch.cat([b.input_ids[0] for b in interleaved]), expected)
    counts = [len(r) for r in replicas]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    for batches in replicas:
        for batch in batches[:-1]:
            check_batch(batch, seq_len, rows)
    if dp_size == 30:   # more replicas than documents: documents are split between replicas
        assert len(documents) < dp_size and min(counts) >= 1


@pytest.mark.parametrize("dp_size", [2, 3, 30])
def test_every_replica_gets_the_same_number_of_batches(dp_size):
    documents, seed, seq_len, rows = random_documents(count=23), seeded(2), 31, 3
    total = sum(d.numel() for d in documents)
    per_global = dp_size * seq_len * rows
    dropped = [len(list(stream(documents, seq_len, rows, dp_rank=r, dp_size=dp_size, seed=seed, epochs=1)))
               for r in range(dp_size)]
    assert dropped == [total // per_global] * dp_size
    # the endless stream: the ceil(total / global batch) batches that cover epoch 0 on every replica
    covering = math.ceil(total / per_global)
    streams = [stream(documents, seq_len, rows, dp_rank=r, dp_size=dp_size, seed=seed)
               for r in range(dp_size)]
    taken = [[next(s) for _ in range(covering)] for s in streams]
    interleaved = torch.cat([taken[r][k].input_ids[0] for k in range(covering) for r in range(dp_size)])
    assert torch.equal(interleaved[:total], epoch_stream(documents, seed))
    states = [s.state_dict() for s in streams]
    assert all(state == states[0] for state in states)    # any rank's state restores every rank


# (dp, rows, seq_len) when saved -> when resumed
@pytest.mark.parametrize("before,after", [((2, 3, 29), (3, 2, 29)), ((4, 1, 16), (1, 3, 40)),
                                          ((3, 2, 10), (7, 1, 10))])
def test_resume_under_another_layout_neither_skips_nor_repeats(before, after):
    """dp, rows and seq_len may change between save and resume: the new replicas go on from the first
    token no replica had seen."""
    documents, seed = random_documents(count=19), seeded(4)
    dp, rows, seq_len = before
    old = [stream(documents, seq_len, rows, dp_rank=r, dp_size=dp, seed=seed) for r in range(dp)]
    seen = [[next(s) for _ in range(5)] for s in old]
    consumed = torch.cat([seen[r][k].input_ids[0] for k in range(5) for r in range(dp)])
    state = json.loads(json.dumps(old[0].state_dict()))
    dp, rows, seq_len = after
    new = [stream(documents, seq_len, rows, dp_rank=r, dp_size=dp, seed=seed) for r in range(dp)]
    for s in new:
        s.load_state_dict(state)
    more = [[next(s) for _ in range(6)] for s in new]
    continued = torch.cat([more[r][k].input_ids[0] for k in range(6) for r in range(dp)])
    whole = torch.cat([consumed, continued])
    expected = epoch_stream(documents, seed, epochs=3)[:whole.numel()]
    assert torch.equal(whole, expected)


def test_concatenate_packing_runs_rows_across_documents():
    documents, seed = random_documents(count=15, max_len=40), seeded(6)
    seq_len, rows = 50, 3
    by_document = stream(documents, seq_len, rows, seed=seed)
    concatenated = stream(documents, seq_len, rows, seed=seed, packing="concatenate")
    boundaries_inside_rows = 0
    for _ in range(10):
        a, b = next(by_document), next(concatenated)
        assert torch.equal(a.input_ids, b.input_ids)              # the same tokens
        boundaries_inside_rows += a.num_docs - rows                # documents end inside rows ...
        # ... one sequence per row
        assert b.cu_seqlens.tolist() == list(range(0, seq_len * rows + 1, seq_len))
        assert b.position_ids[0].tolist() == list(range(seq_len)) * rows
        ids, labels = b.input_ids[0], b.labels[0]
        for start in range(0, seq_len * rows, seq_len):           # labels cross document boundaries
            assert torch.equal(labels[start:start + seq_len - 1], ids[start + 1:start + seq_len])
            assert labels[start + seq_len - 1] == IGNORE_INDEX
        assert b.num_label_tokens == seq_len * rows - rows == int((labels != IGNORE_INDEX).sum())
    assert boundaries_inside_rows > 0


def test_from_config_reads_packing_and_rejects_bad_use(tmp_path):
    for i in range(4):
        (tmp_path / f"d{i}.txt").write_text("some text " * (i + 3))
    config = DataConfig(source=str(tmp_path), packing="concatenate", val_fraction=0.0)
    batches = TokenBatches.from_config(config, 8, 2)
    assert batches.packing == "concatenate" and next(batches).num_docs == 2
    with pytest.raises(ConfigError, match=r"no val documents"):
        TokenBatches.from_config(config, 8, 2, split="val")
    with pytest.raises(ConfigError, match=r"data\.packing"):
        TokenBatches.from_config(DataConfig(source=str(tmp_path), packing="shuffle"), 8, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        TokenBatches.from_config(config, 8, 2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        TokenBatches(load_dataset(config).train, 0, 2)


def test_a_state_of_other_data_or_seed_is_refused():
    documents = random_documents(count=9)
    state = stream(documents, seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"data\.seed"):
        stream(documents, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"data\.source"):
        stream(documents[:-1], seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="version"):
        stream(documents, seed=1).load_state_dict({"epoch": 0})
