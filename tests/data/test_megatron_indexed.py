"""data.source as a Megatron-LM indexed dataset (.bin + .idx written by megatron-core's own builder):
exactly the documents written, the split and vocabulary rules, every damage named, a few training steps."""
import math
import struct
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from gdn_parallel.config import Config, ConfigError, DataConfig
from gdn_parallel.data import check_vocabulary, load_dataset
from gdn_parallel.data.megatron_indexed import HEADER
from tests.data.megatron_builder import joined, random_megatron_documents, write_megatron
from tests.seeds import seeded

if find_spec("megatron") is None:   # not imported here: megatron-core's import is seconds of collection
    pytest.skip("megatron-core is not installed (pip install -e '.[dev]')", allow_module_level=True)
REPO = Path(__file__).resolve().parents[2]


def documents_of(split):
    return [split.document(i).tolist() for i in range(len(split))]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_reader_returns_exactly_the_documents_written(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    written = random_megatron_documents(30, seeded(11), high=200)
    written[4] = []                               # an empty document: no tokens, left out
    written[7] = [[5, 6], [7], [8, 9, 10]]        # one document of three sequences
    prefix = write_megatron(tmp_path / "corpus_text_document", written, dtype=dtype)
    dataset = load_dataset(DataConfig(source=prefix, val_fraction=0.0))
    assert dataset.kind == "megatron" and len(dataset.val) == 0
    assert documents_of(dataset.train) == joined(written)
    assert "1 empty document(s) left out" in dataset.describe()
    # megatron-core's reader agrees: document i is its sequences doc_index[i] .. doc_index[i + 1] - 1
    theirs = IndexedDataset(prefix)
    bounds = theirs.document_indices
    expected = [np.concatenate([theirs[j] for j in range(bounds[i], bounds[i + 1])]).tolist()
                for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
    assert documents_of(dataset.train) == expected
    assert dataset.max_token_id == max(max(doc) for doc in joined(written))
    for named in (prefix + ".bin", prefix + ".idx"):   # either file names the dataset too
        assert documents_of(load_dataset(DataConfig(source=named, val_fraction=0.0)).train) == expected


def test_split_follows_the_prepared_rule_and_is_fixed(tmp_path):
    written = random_megatron_documents(40, seeded(12))
    prefix = write_megatron(tmp_path / "c_text_document", written)
    dataset = load_dataset(DataConfig(source=prefix, val_fraction=0.25))
    train, val = documents_of(dataset.train), documents_of(dataset.val)
    assert 1 <= len(val) < 40 and sorted(train + val) == sorted(joined(written))
    assert documents_of(load_dataset(DataConfig(source=prefix, val_fraction=0.25)).val) == val
    single = write_megatron(tmp_path / "one_text_document", [[[1, 2, 3]]])
    one = load_dataset(DataConfig(source=single, val_fraction=0.9))
    assert len(one.train) == 1 and len(one.val) == 0          # training is never empty


def test_vocabulary_check_reads_the_largest_id(tmp_path):
    prefix = write_megatron(tmp_path / "v_text_document", [[[3, 999]], [[7, 12, 40]]])
    config = DataConfig(source=prefix)
    check_vocabulary(config, 1000)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=999 .*Megatron-LM indexed dataset.* is 999"
                                          r".*>= 1000"):
        check_vocabulary(config, 999)
    signed = write_megatron(tmp_path / "s_text_document", [[[3, -5, 8]]], dtype=np.int16)
    for check in (lambda: check_vocabulary(DataConfig(source=signed), 100),
                  lambda: load_dataset(DataConfig(source=signed))):
        with pytest.raises(ConfigError, match=r"s_text_document\.bin holds the token id -5"):
            check()


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def corrupt(prefix: str, what: str) -> None:
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    sequences = struct.unpack_from("<Q", idx.read_bytes(), 18)[0]
    if what == "magic":
        _patch(idx, 0, b"NOTANIDX\x00")
    elif what == "version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif what == "float dtype":
        _patch(idx, 17, struct.pack("<B", 7))
    elif what == "unknown dtype":
        _patch(idx, 17, struct.pack("<B", 42))
    elif what == "header cut":
        idx.write_bytes(idx.read_bytes()[:20])
    elif what == "index cut":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif what == "index with a tail":
        idx.write_bytes(idx.read_bytes() + b"\x00" * 3)
    elif what == "pointer":
        _patch(idx, HEADER.size + 4 * sequences + 8 * 2, struct.pack("<q", 4))   # sequence 2 points at byte 4
    elif what == "document index":
        _patch(idx, HEADER.size + 12 * sequences + 8, struct.pack("<q", sequences + 5))
    elif what == "bin cut":
        bin_.write_bytes(bin_.read_bytes()[:-4])
    elif what == "bin with a tail":
        bin_.write_bytes(bin_.read_bytes() + b"\x00" * 4)
    elif what == "bin missing":
        bin_.unlink()
    elif what == "idx missing":
        idx.unlink()


@pytest.mark.parametrize("what,file,message", [
    ("magic", ".idx", r"starts with b'NOTANIDX\\x00', not Megatron's"),
    ("version", ".idx", "format version 2"),
    ("float dtype", ".idx", "stores float32 values"),
    ("unknown dtype", ".idx", "dtype code 42"),
    ("header cut", ".idx", "holds 20 bytes, less than its 34-byte header: truncated"),
    ("index cut", ".idx", "need .*: truncated"),
    ("index with a tail", ".idx", "need .*: damaged"),
    ("pointer", ".idx", "damaged: sequence 2 points at byte 4, but the sequences before it end at byte"),
    ("document index", ".idx", "damaged: its document index falls after entry 1"),
    ("bin cut", ".bin", "its index says .*: truncated"),
    ("bin with a tail", ".bin", "not the data of this index"),
    ("bin missing", ".bin", "is missing"),
    ("idx missing", ".idx", "is missing"),
])
def test_a_damaged_dataset_is_named_with_what_is_wrong(tmp_path, what, file, message):
    prefix = write_megatron(tmp_path / "d_text_document", random_megatron_documents(6, seeded(13)))
    corrupt(prefix, what)
    config = DataConfig(source=prefix)
    for read in (lambda: load_dataset(config), lambda: check_vocabulary(config, 256)):
        with pytest.raises(ConfigError, match=rf"data\.source=.*d_text_document{file}.*{message}"):
            read()


def test_a_multimodal_index_is_refused(tmp_path):
    prefix = write_megatron(tmp_path / "m_text_document", [[[1, 2]], [[3]]], multimodal=True)
    with pytest.raises(ConfigError, match=r"m_text_document\.idx holds a mode per sequence"):
        load_dataset(DataConfig(source=prefix))


def test_training_runs_on_a_megatron_prefix(tmp_path):
    from gdn_parallel.train.trainer import run_training
    prefix = write_megatron(tmp_path / "train_text_document", random_megatron_documents(60, seeded(14)))
    config = Config.from_yaml(REPO / "configs" / "tiny-cpu.yaml", [
        "model.n_layers=2", "train.seq_len=64", "train.batch_size=2", "train.steps=3", "train.warmup_steps=1",
        "train.log_every=1", "train.eval_rows=2", f"data.source={prefix}", "data.val_fraction=0.1"])
    lines = []
    summary = run_training(config, print_fn=lines.append)
    data_line = next(line for line in lines if line.startswith("data"))
    assert "train_text_document (megatron, int32 ids" in data_line
    assert summary["steps"] == 3
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["val_loss"])
