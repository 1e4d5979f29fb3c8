"""data.source: text files only (suffixes, never .git or binaries), a split that never empties
training, prepared datasets checked at start-up, the vocabulary check, the data config's fields."""
import json

import numpy as np
import pytest

from gdn_parallel.config import Config, ConfigError, DataConfig
from gdn_parallel.data import TokenBatches, check_vocabulary, load_corpus, load_dataset
from gdn_parallel.data.corpus import split_fraction
from gdn_parallel.data.prepared import METADATA_FILE, OFFSETS_FILE, PARTIAL_DIR, TOKENS_FILE, token_dtype
from tools.prepare_data import main as prepare_data


def write_tree(root, files):
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


def all_names(corpus):
    return sorted(corpus.train_names + corpus.val_names)


def test_directory_reads_text_files_only(tmp_path):
    write_tree(tmp_path, {
        "notes.txt": "plain notes", "guide.md": "# a guide", "src/code.py": "print('hi')\n",
        "table.csv": "a,b\n1,2\n", "records.jsonl": '{"text": "x"}\n',
        ".git/HEAD": "ref: refs/heads/main\n", ".git/description.txt": "text inside .git",
        ".git/objects/pack/pack-1.pack": b"PACK\x00\x00\x00\x02\x9c\x78",
        ".venv/lib/readme.txt": "a virtual environment", "src/__pycache__/code.cpython-311.md": "cache",
        "image.txt": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",          # binary behind a text suffix
        "latin1.txt": "caf\xe9".encode("latin-1"),                        # not UTF-8
        "empty.md": "",
    })
    corpus = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.0))
    assert all_names(corpus) == ["guide.md", "notes.txt", "src/code.py"]
    assert corpus.binary_skipped == 2 and "2 binary file(s) skipped" in corpus.describe()
    everything = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.0, text_suffixes="*"))
    assert all_names(everything) == ["guide.md", "notes.txt", "records.jsonl", "src/code.py", "table.csv"]
    only = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.0, text_suffixes=".CSV, .md"))
    assert all_names(only) == ["guide.md", "table.csv"]
    # a single file or a glob names its files itself, whatever their suffix; binaries stay out
    single = load_corpus(DataConfig(source=str(tmp_path / "table.csv"), val_fraction=0.0))
    assert all_names(single) == ["table.csv"]
    globbed = load_corpus(DataConfig(source=str(tmp_path / "**" / "*.txt"), val_fraction=0.0))
    assert all_names(globbed) == ["notes.txt"]


def test_a_directory_without_matching_files_says_why(tmp_path):
    write_tree(tmp_path, {"a.csv": "1,2", "b.csv": "3,4", "c.bin": b"\x00\x01"})
    with pytest.raises(ConfigError, match=r"data\.source.*data\.text_suffixes.*\.csv x2"):
        load_corpus(DataConfig(source=str(tmp_path)))
    write_tree(tmp_path / "bin", {"x.txt": b"\x00\x01", "y.txt": b"\xff\xfe"})
    with pytest.raises(ConfigError, match=r"2 binary file\(s\) were skipped"):
        load_corpus(DataConfig(source=str(tmp_path / "bin")))


def name_in_validation(val_fraction):
    """A file name that the hash sends to validation."""
    return next(f"doc{i}.txt" for i in range(1000) if split_fraction(f"doc{i}.txt") < val_fraction)


def test_a_single_document_trains_and_the_split_never_empties_training(tmp_path):
    name = name_in_validation(0.5)
    (tmp_path / name).write_text("the only document " * 20)
    for source in (tmp_path / name, tmp_path):
        config = DataConfig(source=str(source), val_fraction=0.5)
        corpus = load_corpus(config)
        assert corpus.train_names == [name] and corpus.val == []
        batch = next(TokenBatches.from_config(config, 16, 2))
        assert batch.num_tokens == 32
    (tmp_path / name_in_validation(0.01).replace("doc", "other")).write_text("a second document")
    two = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.01))
    assert len(two.train) == 1 and len(two.val) == 1   # one held out, one trains


def prepare(tmp_path, files, *extra):
    inputs = tmp_path / "inputs"
    write_tree(inputs, files)
    out = tmp_path / "prepared"
    assert prepare_data([str(inputs), "--out", str(out), "--progress", "off", *extra]) == 0
    return out


def test_prepared_dataset_split_and_vocabulary(tmp_path):
    out = prepare(tmp_path, {f"d{i}.txt": f"document {i} " * (i + 1) for i in range(40)})
    config = DataConfig(source=str(out), val_fraction=0.1)
    dataset = load_dataset(config)
    assert dataset.kind == "prepared" and len(dataset.train) + len(dataset.val) == 40
    assert 1 <= len(dataset.val) <= 12 and dataset.max_token_id == ord("u")   # the largest byte of the text
    again = load_dataset(config)
    assert np.array_equal(again.val.starts, dataset.val.starts)   # the split is fixed
    check_vocabulary(config, ord("u") + 1)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=100 .*largest token id .* is 117.*>= 118"):
        check_vocabulary(config, 100)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=255 .*read as bytes.*>= 256"):
        check_vocabulary(DataConfig(), 255)
    with pytest.raises(ConfigError, match="load_dataset"):
        load_corpus(config)
    single = prepare(tmp_path / "one", {"only.txt": "one document"})
    one = load_dataset(DataConfig(source=str(single), val_fraction=0.9))
    assert len(one.train) == 1 and len(one.val) == 0


def corrupt(out, what):
    if what == "missing index":
        (out / OFFSETS_FILE).unlink()
    elif what == "garbage index":
        (out / OFFSETS_FILE).write_bytes(b"not numpy at all")
    elif what == "index of another length":
        np.save(out / OFFSETS_FILE, np.array([0, 3], dtype=np.int64))
    elif what == "index out of order":
        offsets = np.load(out / OFFSETS_FILE)
        offsets[1], offsets[2] = offsets[2], offsets[1]
        np.save(out / OFFSETS_FILE, offsets)
    elif what == "truncated tokens":
        data = (out / TOKENS_FILE).read_bytes()
        (out / TOKENS_FILE).write_bytes(data[:-2])
    elif what == "metadata not JSON":
        (out / METADATA_FILE).write_text("{", encoding="utf-8")
    elif what == "newer format":
        metadata = json.loads((out / METADATA_FILE).read_text())
        (out / METADATA_FILE).write_text(json.dumps({**metadata, "format_version": 99}))
    elif what == "unfinished":
        (out / METADATA_FILE).unlink()
        (out / PARTIAL_DIR).mkdir()


@pytest.mark.parametrize("what,message", [
    ("missing index", "document index offsets.npy is missing"),
    ("garbage index", "offsets.npy cannot be read"),
    ("index of another length", r"not int64 \(4,\)"),
    ("index out of order", "offsets.npy is corrupt"),
    ("truncated tokens", "tokens.bin holds"),
    ("metadata not JSON", "gdn_tokens.json cannot be read"),
    ("newer format", "format_version 99"),
    ("unfinished", "unfinished preparation"),
])
def test_a_broken_prepared_dataset_fails_at_start_up_naming_data_source(tmp_path, what, message):
    out = prepare(tmp_path, {"a.txt": "first", "b.txt": "second", "c.txt": "third"})
    corrupt(out, what)
    with pytest.raises(ConfigError, match=rf"data\.source=.*{message}"):
        load_dataset(DataConfig(source=str(out)))


def test_missing_sources_and_bad_fields_name_the_field(tmp_path):
    for source in (tmp_path / "nope", tmp_path / "nope.txt"):
        with pytest.raises(ConfigError, match=r"data\.source=.* does not exist"):
            load_dataset(DataConfig(source=str(source)))
    with pytest.raises(ConfigError, match=r"data\.packing='rows'"):
        Config().with_overrides(["data.packing=rows"]).validate()
    for bad in ("txt", ".txt,,.md", ".t*t", "", "*.txt"):
        with pytest.raises(ConfigError, match=r"data\.text_suffixes"):
            DataConfig(text_suffixes=bad).validate()
    with pytest.raises(ConfigError, match=r"data\.text_suffixes"):
        Config.from_dict({"data": {"text_suffixes": [".txt"]}}).validate()
    assert DataConfig(text_suffixes=" .TXT , .md").suffixes == (".txt", ".md")
    assert DataConfig(text_suffixes="*").suffixes == ()


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(256) == "uint16" and token_dtype(2 ** 16) == "uint16"
    assert token_dtype(2 ** 16 + 1) == "uint32" and token_dtype(152_064) == "uint32"
