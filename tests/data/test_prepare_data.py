"""tools/prepare_data.py: round trips (bytes, a tokenizers tokenizer, JSON lines, Parquet), worker
count independence (one large JSON-lines file split among the workers, the output byte for byte the
serial run's), resuming an interrupted run, refusing to overwrite, bad inputs; the UTF-8 bytes each
token stands for (val_bpb's) and the tokenizer's copy and special tokens (exports')."""
import json
import re
import sys

import numpy as np
import pytest

import tools.prepare_data as tool
from gdn_parallel.config import DataConfig
from gdn_parallel.data import load_corpus, load_dataset
from gdn_parallel.data.prepared import METADATA_FILE, OFFSETS_FILE, PARTIAL_DIR, TOKEN_BYTES_FILE, TOKENS_FILE
from tests.data.test_sources import write_tree

TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(30)]


def run(inputs, out, *extra):
    return tool.main([*map(str, inputs), "--out", str(out), "--progress", "off", *extra])


def documents_of(out):
    """Every document of a prepared dataset, in file order, as a list of ids."""
    tokens = np.fromfile(out / TOKENS_FILE, dtype=json.loads((out / METADATA_FILE).read_text())["dtype"])
    offsets = np.load(out / OFFSETS_FILE)
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def jsonl(texts, key="text"):
    return "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts))


def test_bytes_round_trip_text_and_jsonl(tmp_path):
    write_tree(tmp_path / "in", {"a.txt": "héllo wörld", "b/c.md": "# notes\n",
                                 "d.jsonl": jsonl(TEXTS) + "\n", "skip.txt": b"\x00binary",
                                 "e.csv": "left,out"})
    out = tmp_path / "out"
    assert run([tmp_path / "in"], out) == 0
    metadata = json.loads((out / METADATA_FILE).read_text())
    expected = [list("héllo wörld".encode()), list(b"# notes\n")] + [list(t.encode()) for t in TEXTS]
    assert documents_of(out) == expected
    assert metadata["dtype"] == "uint16" and metadata["vocab_size"] == 256
    assert metadata["tokenizer"] == {"kind": "bytes", "vocab_size": 256}
    assert metadata["num_documents"] == 32 and metadata["num_tokens"] == sum(map(len, expected))
    assert metadata["max_token_id"] == max(max(d) for d in expected)
    assert metadata["skipped"] == {"binary_files": 1, "empty_documents": 0}
    assert [s["path"].rsplit("/", 1)[-1] for s in metadata["sources"]] == \
        ["a.txt", "c.md", "d.jsonl", "skip.txt"]
    assert not (out / PARTIAL_DIR).exists()
    # the same ids data.source reads from the text files directly
    direct = load_corpus(DataConfig(source=str(tmp_path / "in" / "b"), val_fraction=0.0))
    prepared = load_dataset(DataConfig(source=str(out), val_fraction=0.0))
    assert direct.train[0].tolist() in [prepared.train.document(i).tolist()
                                        for i in range(len(prepared.train))]


def test_workers_and_shard_sizes_do_not_change_the_output(tmp_path):
    write_tree(tmp_path / "in", {"big.jsonl": jsonl(TEXTS * 3), **{f"t{i}.txt": TEXTS[i] for i in range(7)}})
    outputs = []
    for index, extra in enumerate((["--workers", "1"], ["--workers", "2", "--shard-mb", "0.001"])):
        out = tmp_path / f"out{index}"
        assert run([tmp_path / "in"], out, *extra) == 0
        outputs.append(out)
    for name in (TOKENS_FILE, OFFSETS_FILE):
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes()


def test_text_key_is_taken_where_an_input_has_records(tmp_path):
    write_tree(tmp_path / "in", {"a.txt": "plain", "b.jsonl": jsonl(["rec"], key="body")})
    assert run([tmp_path / "in"], tmp_path / "out", "--text-key", "body") == 0
    assert documents_of(tmp_path / "out") == [list(b"plain"), list(b"rec")]


def test_shards_are_cut_for_the_workers():
    mib = 2 ** 20
    assert tool.shard_size(64 * mib, 40 * mib, 1) == 64 * mib          # one worker: --shard-mb as given
    assert tool.shard_size(64 * mib, 40 * mib, 2) == 40 * mib // (2 * tool.SHARDS_PER_WORKER)
    assert tool.shard_size(64 * mib, 3 * mib, 2) == tool.MIN_SPLIT_BYTES    # not below 1 MiB
    assert tool.shard_size(mib // 2, 3 * mib, 2) == mib // 2            # nor above --shard-mb
    assert tool.shard_size(2 * mib, 10 ** 11, 8) == 2 * mib


def large_jsonl(count=600):
    """Documents of every kind a split must keep whole and in order: long and short, non-ASCII, empty
    ones, blank lines between records."""
    texts = [f"doc {i} naïve café 😀 " + "the quick brown fox jumps over the lazy dog " * (1 + i * 7 % 40)
             for i in range(count)]
    lines = [json.dumps({"text": "" if i % 97 == 0 else t, "n": i}) + ("\n\n" if i % 50 == 0 else "\n")
             for i, t in enumerate(texts)]
    return "".join(lines), texts


@pytest.mark.parametrize("tokenizer", ["bytes", "file"])
def test_one_large_jsonl_is_split_among_the_workers_with_the_serial_output(tmp_path, monkeypatch, capsys,
                                                                             tokenizer):
    """The issue's case: --workers 2 on one JSON-lines file ran one shard. Now the file is cut into
    line ranges for every worker, and every output file is byte for byte the one of --workers 1."""
    content, texts = large_jsonl()
    write_tree(tmp_path / "in", {"big.jsonl": content})
    extra = []
    if tokenizer == "file":
        from tests.tokenized_data import byte_level_bpe
        byte_level_bpe(tmp_path / "tok.json", texts[:50])
        extra = ["--tokenizer", str(tmp_path / "tok.json")]
    monkeypatch.setattr(tool, "MIN_SPLIT_BYTES", 4096)       # a test-sized file split as a large one is
    assert run([tmp_path / "in"], tmp_path / "serial", *extra, "--workers", "1") == 0
    assert run([tmp_path / "in"], tmp_path / "parallel", *extra, "--workers", "2", "--progress", "lines") == 0
    shards = {int(total) for total in re.findall(r"shard \d+/(\d+)", capsys.readouterr().err)}
    assert shards == {2 * tool.SHARDS_PER_WORKER}
    names = sorted(path.name for path in (tmp_path / "serial").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "parallel").iterdir())
    for name in names:
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "parallel" / name).read_bytes(), name
    assert len(documents_of(tmp_path / "parallel")) == sum(1 for i in range(len(texts)) if i % 97)


class Killed(BaseException):
    """Stands for the process being killed mid-run (caught by nothing in the tool)."""


def test_an_interrupted_run_resumes_after_its_last_complete_shard(tmp_path, monkeypatch, capsys):
    write_tree(tmp_path / "in", {"part.jsonl": jsonl(TEXTS * 4), **{f"t{i}.txt": TEXTS[i] for i in range(5)}})
    args = ["--shard-mb", "0.002"]
    assert run([tmp_path / "in"], tmp_path / "whole", *args) == 0
    calls, kill_at_call = [], [3]
    real = tool.prepare_shard

    def interrupted(task):
        calls.append(task[0])
        if len(calls) == kill_at_call[0]:
            raise Killed
        return real(task)

    monkeypatch.setattr(tool, "prepare_shard", interrupted)
    out = tmp_path / "out"
    with pytest.raises(Killed):
        run([tmp_path / "in"], out, *args)
    shards = len(json.loads((out / PARTIAL_DIR / "plan.json").read_text())["shards"])
    assert shards > 4 and not (out / METADATA_FILE).exists()
    with pytest.raises(ValueError, match="unfinished preparation"):
        load_dataset(DataConfig(source=str(out)))
    # other arguments do not mix with the unfinished run
    assert run([tmp_path / "in"], out, "--shard-mb", "0.003") == 2
    assert "--force" in capsys.readouterr().err
    calls.clear()
    kill_at_call[0] = None
    assert run([tmp_path / "in"], out, *args, "--progress", "lines") == 0
    assert sorted(calls) == list(range(2, shards))           # shards 0 and 1 were kept
    assert "resuming: 2/" in capsys.readouterr().err
    for name in (TOKENS_FILE, OFFSETS_FILE):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_a_run_resumes_under_another_worker_count_with_its_plan(tmp_path, monkeypatch):
    write_tree(tmp_path / "in", {"part.jsonl": jsonl(TEXTS * 4)})
    args = ["--shard-mb", "0.002"]
    assert run([tmp_path / "in"], tmp_path / "whole", *args) == 0
    real = tool.prepare_shard

    def interrupted(task):
        if task[0] == 2:
            raise Killed
        return real(task)

    monkeypatch.setattr(tool, "prepare_shard", interrupted)
    with pytest.raises(Killed):
        run([tmp_path / "in"], tmp_path / "out", *args)
    monkeypatch.setattr(tool, "prepare_shard", real)
    assert run([tmp_path / "in"], tmp_path / "out", *args, "--workers", "2") == 0
    for name in (TOKENS_FILE, OFFSETS_FILE):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_a_finished_dataset_is_overwritten_only_with_force(tmp_path, capsys):
    write_tree(tmp_path / "in", {"a.txt": "first version"})
    out = tmp_path / "out"
    assert run([tmp_path / "in"], out) == 0
    (tmp_path / "in" / "a.txt").write_text("second")
    assert run([tmp_path / "in"], out) == 2
    assert "already holds a finished dataset; pass --force" in capsys.readouterr().err
    assert documents_of(out) == [list(b"first version")]
    assert run([tmp_path / "in"], out, "--force") == 0
    assert documents_of(out) == [list(b"second")]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.me").write_text("not ours")
    assert run([tmp_path / "in"], tmp_path / "other", "--force") == 2
    assert "holds other files (keep.me)" in capsys.readouterr().err


@pytest.mark.parametrize("files,extra,message", [
    ({"a.jsonl": jsonl(["x"], key="content")}, [], r"no key 'text' .*--text-key"),
    ({"a.jsonl": '{"text": 3}\n'}, [], "holds a int, not text"),
    ({"a.jsonl": "not json\n"}, [], "not a JSON line"),
    ({"a.txt": "x"}, ["--tokenizer", "missing.json"], "no such file"),
    ({"a.txt": "x"}, ["--suffixes", "txt"], "--suffixes"),
    ({"a.txt": "x"}, ["--workers", "0"], "--workers"),
    ({"a.csv": "x"}, [], r"no file with a suffix"),
    ({"a.txt": "x", "b.md": "y"}, ["--text-key", "body"],
     r"--text-key 'body' names the text field of JSON-lines / Parquet records, .*\(a\.txt, b\.md\) are "
     r"text files.*drop --text-key"),
    ({"a.txt": b"\x00"}, [], r"no documents \(1 binary"),
])
def test_bad_inputs_fail_with_a_message(tmp_path, capsys, files, extra, message):
    write_tree(tmp_path / "in", files)
    assert run([tmp_path / "in"], tmp_path / "out", *extra) == 2
    assert re.search(message, capsys.readouterr().err)
    assert run([tmp_path / "nothing-here"], tmp_path / "out2") == 2
    assert "does not exist" in capsys.readouterr().err


def test_optional_libraries_missing_say_what_to_install(tmp_path, monkeypatch, capsys):
    write_tree(tmp_path / "in", {"a.parquet": b"PAR1", "t.txt": "x"})
    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert run([tmp_path / "in" / "t.txt"], tmp_path / "o1", "--tokenizer", str(tmp_path / "tok.json")) == 2
    assert "pip install tokenizers" in capsys.readouterr().err
    assert run([tmp_path / "in" / "a.parquet"], tmp_path / "o2") == 2
    assert "pip install pyarrow" in capsys.readouterr().err


def small_tokenizer(path, texts, vocab_size=120):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=vocab_size,
                                                                          special_tokens=["[UNK]"]))
    tokenizer.save(str(path))
    return tokenizer


def test_tokenizers_round_trip_and_vocabulary_check(tmp_path):
    tokenizer = small_tokenizer(tmp_path / "tok.json", TEXTS)
    write_tree(tmp_path / "in", {"a.jsonl": jsonl(TEXTS)})
    out = tmp_path / "out"
    assert run([tmp_path / "in"], out, "--tokenizer", str(tmp_path / "tok.json"), "--workers", "2",
               "--shard-mb", "0.001") == 0
    assert documents_of(out) == [tokenizer.encode(t).ids for t in TEXTS]
    metadata = json.loads((out / METADATA_FILE).read_text())
    assert metadata["tokenizer"]["kind"] == "tokenizers" and len(metadata["tokenizer"]["sha256"]) == 64
    assert metadata["vocab_size"] == tokenizer.get_vocab_size() and metadata["dtype"] == "uint16"
    from gdn_parallel.config import ConfigError
    from gdn_parallel.data import check_vocabulary
    config = DataConfig(source=str(out))
    check_vocabulary(config, metadata["max_token_id"] + 1)
    with pytest.raises(ConfigError, match=r"model\.vocab_size"):
        check_vocabulary(config, metadata["max_token_id"])


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = len(vocab)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    write_tree(tmp_path / "in", {"a.jsonl": jsonl(["w1 w69999 w65536", "w2 unknown"])})
    out = tmp_path / "out"
    assert run([tmp_path / "in"], out, "--tokenizer", str(tmp_path / "tok.json")) == 0
    metadata = json.loads((out / METADATA_FILE).read_text())
    assert metadata["dtype"] == "uint32" and metadata["max_token_id"] == 70_000
    assert documents_of(out) == [[1, 69999, 65536], [2, 70_000]]
    dataset = load_dataset(DataConfig(source=str(out), val_fraction=0.0))
    assert sorted(dataset.train.document(i).tolist() for i in range(2)) == [[1, 69999, 65536], [2, 70_000]]


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    (tmp_path / "in").mkdir()
    table = pa.table({"body": TEXTS[:12] + [None, ""], "n": list(range(14))})
    pq.write_table(table, tmp_path / "in" / "rows.parquet", row_group_size=4)
    out = tmp_path / "out"
    assert run([tmp_path / "in"], out, "--text-key", "body", "--shard-mb", "0.0001") == 0
    assert documents_of(out) == [list(t.encode()) for t in TEXTS[:12]]
    assert json.loads((out / METADATA_FILE).read_text())["skipped"]["empty_documents"] == 2


def test_a_tokenizer_file_records_each_tokens_bytes_and_its_special_tokens(tmp_path):
    from tests.tokenized_data import BOS, EOS, PAD, prepare_bpe_dataset, texts
    documents = texts()
    out = prepare_bpe_dataset(tmp_path, documents, "--workers", "2", "--shard-mb", "0.001")
    metadata = json.loads((out / METADATA_FILE).read_text())
    counts = np.fromfile(out / TOKEN_BYTES_FILE, dtype=metadata["text_bytes"]["dtype"])
    offsets = np.load(out / OFFSETS_FILE)
    # every document's bytes counted once over its tokens (gaps, accents, an emoji split over tokens)
    assert [int(counts[a:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])] == \
        [len(t.encode()) for t in documents]
    assert metadata["text_bytes"] == {"num_bytes": sum(len(t.encode()) for t in documents),
                                      "file": TOKEN_BYTES_FILE, "dtype": "uint8"}
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    special = metadata["tokenizer"]["special_tokens"]
    assert {role: (token["content"], token["id"]) for role, token in special.items()} == {
        "bos_token": (BOS, 0), "eos_token": (EOS, 1), "pad_token": (PAD, 2)}
    assert special["bos_token"]["from"] == "the tokenizer's post-processor template"
    assert special["pad_token"]["from"] == "--pad-token"
    # the dataset's validation documents carry their tokens' byte counts, document for document
    dataset = load_dataset(DataConfig(source=str(out), val_fraction=0.2))
    assert len(dataset.val) > 1 and dataset.val_token_bytes.lengths.tolist() == dataset.val.lengths.tolist()


def test_special_tokens_from_transformers_files_and_flags_and_unknown_ones(tmp_path, capsys):
    from tests.tokenized_data import byte_level_bpe, texts
    (tmp_path / "tok").mkdir()
    byte_level_bpe(tmp_path / "tok" / "tokenizer.json", texts())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    write_tree(tmp_path / "in", {"a.txt": "the quick brown fox"})
    tok = str(tmp_path / "tok" / "tokenizer.json")
    assert run([tmp_path / "in"], tmp_path / "o1", "--tokenizer", tok, "--bos-token", "</s>") == 0
    special = json.loads((tmp_path / "o1" / METADATA_FILE).read_text())["tokenizer"]["special_tokens"]
    assert (special["bos_token"]["id"], special["bos_token"]["from"]) == (1, "--bos-token")
    assert special["eos_token"]["id"] == 2 and special["eos_token"]["from"].endswith("tokenizer_config.json")
    assert special["pad_token"] is None
    assert run([tmp_path / "in"], tmp_path / "o2", "--tokenizer", tok, "--eos-token", "<end>") == 2
    assert "eos_token '<end>' (from --eos-token) is not a token of --tokenizer" in capsys.readouterr().err
    assert run([tmp_path / "in"], tmp_path / "o3", "--bos-token", "<s>") == 2   # bytes have none
    assert "byte-level data (--tokenizer bytes) has no special tokens" in capsys.readouterr().err


def test_bytes_per_token_follow_the_offsets_and_add_up_to_the_text():
    from gdn_parallel.data.text_tokenizer import text_bytes_per_token
    # "é" is 2 bytes, the emoji 4 split over two byte-level tokens (same offsets); a special token
    # (0, 0) first and last; a gap (the space) goes to the token after it; trailing text to the last
    text = "é😀 ab  "
    offsets = [(0, 0), (0, 1), (1, 2), (1, 2), (3, 4), (4, 5), (0, 0)]
    assert text_bytes_per_token(text, offsets).tolist() == [0, 2, 4, 0, 2, 3, 0]
    assert text_bytes_per_token("abc", [(0, 0), (0, 0)]).tolist() == [3, 0]   # nothing covered: the first


def test_damaged_byte_counts_are_named(tmp_path):
    from gdn_parallel.config import ConfigError
    from tests.tokenized_data import prepare_bpe_dataset, texts
    out = prepare_bpe_dataset(tmp_path, texts(10))
    with open(out / TOKEN_BYTES_FILE, "r+b") as fh:
        fh.truncate(7)
    with pytest.raises(ConfigError, match=rf"{TOKEN_BYTES_FILE} holds 7 bytes, not \d+ uint8 counts"):
        load_dataset(DataConfig(source=str(out)))


def test_prepared_bytes_count_one_byte_per_token(tmp_path):
    write_tree(tmp_path / "in", {f"{i}.txt": f"text {i} é" * 5 for i in range(6)})
    assert run([tmp_path / "in"], tmp_path / "out") == 0
    metadata = json.loads((tmp_path / "out" / METADATA_FILE).read_text())
    assert metadata["text_bytes"] == {"num_bytes": metadata["num_tokens"], "each_token": 1}
    assert not (tmp_path / "out" / TOKEN_BYTES_FILE).exists()
    dataset = load_dataset(DataConfig(source=str(tmp_path / "out"), val_fraction=0.5))
    assert set(np.unique(dataset.val_token_bytes.tokens).tolist()) == {1}
