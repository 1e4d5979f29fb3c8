"""Corpus loading and packing invariants."""
import pytest
import torch

from gdn_parallel.config import DataConfig
from gdn_parallel.data.corpus import load_corpus, split_fraction
from gdn_parallel.data.packing import (
    IGNORE_INDEX,
    PackedBatch,
    document_stream,
    num_label_tokens,
    pack_pieces,
    packed_batches,
)
from tests.seeds import generator


def random_docs(n=23, seed=0, max_len=300):
    g = generator(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    lengths[3] = 1  # a one-token document
    lengths[5] = 5 * max_len  # longer than a row and than a batch
    return [torch.randint(0, 256, (length,), generator=g, dtype=torch.uint8) for length in lengths]


def check_batch(batch: PackedBatch, seq_len: int, batch_size: int, full: bool = True):
    total = batch.input_ids.shape[1]
    for t in (batch.input_ids, batch.labels, batch.position_ids):
        assert t.shape == (1, total) and t.dtype == torch.long
    if full:
        assert total == seq_len * batch_size
    cu = batch.cu_seqlens
    assert cu.dtype == torch.long and cu[0] == 0 and cu[-1] == total
    assert bool((cu[1:] > cu[:-1]).all())
    # every row boundary is a document boundary
    assert set(range(0, total, seq_len)) <= set(cu.tolist())
    # positions restart at every boundary and count up inside a piece
    starts = (batch.position_ids[0] == 0).nonzero().flatten()
    assert starts.tolist() == cu[:-1].tolist()
    ids, labels = batch.input_ids[0], batch.labels[0]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert batch.position_ids[0, a:b].tolist() == list(range(b - a))
        assert labels[a:b - 1].tolist() == ids[a + 1:b].tolist()
        assert labels[b - 1].item() == IGNORE_INDEX
    assert batch.num_label_tokens == int((labels != IGNORE_INDEX).sum())
    assert batch.num_label_tokens == num_label_tokens(total, batch.num_docs)
    assert 0 <= int(ids.min()) and int(ids.max()) < 256


@pytest.mark.parametrize("seq_len,batch_size", [(64, 4), (17, 3), (1000, 1)])
def test_packed_batches_shapes_boundaries_labels(seq_len, batch_size):
    docs = random_docs()
    batches = packed_batches(docs, seq_len, batch_size, seed=1)
    for _ in range(30):
        check_batch(next(batches), seq_len, batch_size)


def test_one_epoch_has_every_token_exactly_once_in_shuffled_order():
    docs = random_docs()
    seq_len, batch_size, seed = 50, 3, 7
    batches = list(packed_batches(docs, seq_len, batch_size, seed=seed, epochs=1, drop_last=False))
    for b in batches[:-1]:
        check_batch(b, seq_len, batch_size)
    check_batch(batches[-1], seq_len, batch_size, full=False)
    order = list(document_stream(len(docs), seed, epochs=1))
    assert sorted(order) == list(range(len(docs)))
    assert order != sorted(order)  # shuffled
    stream = torch.cat([b.input_ids[0] for b in batches])
    expected = torch.cat([docs[i].long() for i in order])
    assert torch.equal(stream, expected)  # nothing lost, duplicated or reordered inside a document
    # piece boundaries are document ends or row boundaries, nothing else
    doc_ends = set(torch.cumsum(torch.tensor([docs[i].numel() for i in order]), 0).tolist())
    offset = 0
    for b in batches:
        for end in b.cu_seqlens[1:].tolist():
            assert (offset + end) in doc_ends or end % seq_len == 0
        offset += b.num_tokens
    # one-token documents carry no label
    assert sum(b.num_label_tokens for b in batches) <= stream.numel() - len(docs)


def test_drop_last_and_second_epoch_reshuffles():
    docs = random_docs()
    total = sum(d.numel() for d in docs)
    seq_len, batch_size = 40, 2
    full = list(packed_batches(docs, seq_len, batch_size, seed=0, epochs=1))
    assert len(full) == total // (seq_len * batch_size)
    two = torch.cat([b.input_ids[0] for b in
                     packed_batches(docs, seq_len, batch_size, seed=0, epochs=2, drop_last=False)])
    assert two.numel() == 2 * total
    assert torch.equal(torch.bincount(two, minlength=256),
                       2 * torch.bincount(torch.cat([d.long() for d in docs]), minlength=256))
    first, second = list(document_stream(len(docs), 0, epochs=2))[:len(docs)], \
        list(document_stream(len(docs), 0, epochs=2))[len(docs):]
    assert sorted(second) == sorted(first) and second != first


def test_deterministic_and_seed_dependent():
    docs = random_docs()

    def take(seed, n=5):
        it = packed_batches(docs, 64, 2, seed=seed)
        return [next(it) for _ in range(n)]

    a, b, c = take(3), take(3), take(4)
    for x, y in zip(a, b):
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(x, name), getattr(y, name))
    assert any(not torch.equal(x.input_ids, z.input_ids) for x, z in zip(a, c))


def test_long_document_is_cut_into_row_pieces_and_short_documents_work():
    doc = torch.arange(10 * 32) % 256
    batch = next(packed_batches([doc], 32, 4, seed=0))
    assert batch.cu_seqlens.tolist() == [0, 32, 64, 96, 128]
    assert torch.equal(batch.input_ids[0], doc[:128])
    singles = [bytes([i]) for i in range(10)]  # documents of one token: no labels at all
    batch = next(packed_batches(singles, 5, 2, seed=0))
    assert batch.num_docs == 10 and batch.num_label_tokens == 0
    assert bool((batch.labels == IGNORE_INDEX).all())


def test_packed_batch_to_and_bad_inputs():
    batch = pack_pieces([torch.tensor([1, 2, 3]), torch.tensor([4])])
    moved = batch.to("cpu")
    assert torch.equal(moved.labels, torch.tensor([[2, 3, -100, -100]]))
    assert moved.max_seqlen == 3
    with pytest.raises(ValueError):
        next(packed_batches([b"", torch.empty(0, dtype=torch.uint8)], 8, 1))
    with pytest.raises(ValueError):
        next(packed_batches([b"abc"], 0, 1))


def test_stdlib_corpus_nonempty_and_split_deterministic():
    corpus = load_corpus(DataConfig())
    assert len(corpus.train) > 100 and len(corpus.val) > 0
    assert corpus.num_train_tokens > 1_000_000
    assert all(d.dtype == torch.uint8 and d.numel() > 0 for d in corpus.train)
    assert not set(corpus.train_names) & set(corpus.val_names)
    assert not any("site-packages" in n for n in corpus.train_names + corpus.val_names)
    assert all(split_fraction(n) < 0.02 for n in corpus.val_names)
    again = load_corpus(DataConfig())
    assert again.val_names == corpus.val_names and again.train_names[:50] == corpus.train_names[:50]
    none_val = load_corpus(DataConfig(val_fraction=0.0))
    assert not none_val.val and len(none_val.train) == len(corpus.train) + len(corpus.val)


def test_directory_and_glob_sources(tmp_path):
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_bytes(f"document number {i}\n".encode() * (i + 1))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "nested.md").write_text("héllo wörld", encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    corpus = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.2))
    assert len(corpus.train) + len(corpus.val) == 7  # the empty file is no document
    assert len(corpus.val) >= 1 and len(corpus.train) >= 1
    assert b"".join(bytes(d.tolist()) for d in corpus.train + corpus.val).count("wörld".encode()) == 1
    globbed = load_corpus(DataConfig(source=str(tmp_path / "*.txt"), val_fraction=0.0))
    assert sorted(globbed.train_names) == [f"doc{i}.txt" for i in range(6)]


@pytest.mark.parametrize("make_source", [
    lambda p: str(p / "does-not-exist"),
    lambda p: str(p),                          # an empty directory
    lambda p: str(p / "*.nothing"),            # a glob that matches nothing
])
def test_bad_source_raises_naming_data_source(tmp_path, make_source):
    with pytest.raises(ValueError, match=r"data\.source"):
        load_corpus(DataConfig(source=make_source(tmp_path)))
