"""val_bpb is bits per byte of the validation text: the summed loss of the labelled tokens of the
validation set, in nats, / ln 2 / the UTF-8 bytes their targets stand for. With a BPE tokenizer it
differs from bits per token (val_bits_per_token, logged beside it) and equals the hand computation
over the validation documents; with bytes the two agree; data that does not record its bytes gets no
val_bpb, and one note saying why."""
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gdn_parallel.config import IGNORE_INDEX, DataConfig
from gdn_parallel.convert import model_from_checkpoint
from gdn_parallel.data import Documents, load_dataset
from gdn_parallel.data.prepared import METADATA_FILE, TOKEN_BYTES_FILE
from gdn_parallel.data.validation import validation_set
from gdn_parallel.train.__main__ import run
from gdn_parallel.train.evaluation import validation_text_bytes
from tests.data.test_sources import write_tree
from tests.tokenized_data import prepare_bpe_dataset, texts

# pure GDN, small; one row of 1024 tokens holds the whole validation split (its documents uncut)
SETTINGS = {"model.hidden_size": 32, "model.gdn_head_dim": 8, "model.n_layers": 2, "model.layer_pattern": "G",
            "train.seq_len": 1024, "train.batch_size": 1, "train.eval_rows": 1, "train.warmup_steps": 0,
            "data.val_fraction": 0.1}


def train(out_dir, steps=1, **settings) -> list:
    """Runs the trainer; returns its evaluation records from metrics.jsonl."""
    overrides = [x for key, value in {**SETTINGS, **settings}.items() for x in ("--set", f"{key}={value}")]
    run(["--steps", str(steps), "--set", f"train.out_dir={out_dir}", *overrides])
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_loss" in r]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    return prepare_bpe_dataset(tmp_path_factory.mktemp("bpe"), texts())


def test_bpe_val_bpb_is_bits_per_byte_of_the_validation_text(bpe_data, tmp_path):
    (record,) = train(tmp_path / "run", **{"data.source": bpe_data, "model.vocab_size": 300})
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(bpe_data.parent / "tokenizer.json"))
    dataset = load_dataset(DataConfig(source=str(bpe_data), val_fraction=0.1))
    model, _ = model_from_checkpoint(tmp_path / "run" / "checkpoints" / "step_1")
    nats, labelled, text_bytes = 0.0, 0, 0
    with torch.no_grad():
        for index in range(len(dataset.val)):   # each document alone: no packing code involved
            ids = dataset.val.document(index)
            logits = model.eval()(ids[None]).logits[0].double()
            nats += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
            labelled += ids.numel() - 1
            text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            assert text in texts()   # the decoded text is the document: its bytes are the document's
            text_bytes += len(text.encode("utf-8"))
    assert len(dataset.val) > 2 and dataset.val.num_tokens < 1024
    assert record["val_loss"] == pytest.approx(nats / labelled, rel=1e-5)
    assert record["val_bits_per_token"] == pytest.approx(record["val_loss"] / math.log(2), rel=1e-12)
    assert record["val_bpb"] == pytest.approx(nats / math.log(2) / text_bytes, rel=1e-5)
    assert record["val_bpb"] < 0.8 * record["val_bits_per_token"]   # BPE tokens hold > 1 byte


def test_byte_level_val_bpb_is_bits_per_token(tmp_path):
    write_tree(tmp_path / "text", {f"doc{i}.txt": f"héllo wörld {i} " * (20 + i) for i in range(30)})
    (record,) = train(tmp_path / "run", **{"data.source": tmp_path / "text", "data.val_fraction": 0.2})
    assert record["val_bpb"] == pytest.approx(record["val_bits_per_token"], rel=1e-12)
    assert record["val_bpb"] == pytest.approx(record["val_loss"] / math.log(2), rel=1e-12)


def test_data_without_byte_counts_gets_no_val_bpb_and_one_note(bpe_data, tmp_path, capsys):
    old = tmp_path / "old-data"
    shutil.copytree(bpe_data, old)
    (old / TOKEN_BYTES_FILE).unlink()   # as prepared before byte counts were recorded
    metadata = json.loads((old / METADATA_FILE).read_text())
    del metadata["text_bytes"]
    (old / METADATA_FILE).write_text(json.dumps(metadata))
    records = train(tmp_path / "run", steps=2, **{"data.source": old, "model.vocab_size": 300,
                                                  "train.eval_every": 1})
    assert len(records) == 2 and all("val_bpb" not in r and r["val_bits_per_token"] > 0 for r in records)
    out = capsys.readouterr().out
    assert out.count("val_bpb not reported") == 1 and "gdn-prepare-data records them" in out


@pytest.mark.parametrize("packing", ["documents", "concatenate"])
def test_the_bytes_are_those_of_the_labelled_targets_of_the_evaluated_rows(packing):
    """Documents cut across short rows: ids that name their own position, so each label says which
    token it predicts, and the bytes of those tokens summed directly."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 40, (12,), generator=generator).tolist()
    total = sum(lengths)
    ids = Documents.from_sequences([list(range(sum(lengths[:i]), sum(lengths[:i + 1]))) for i in range(12)])
    per_token = torch.randint(0, 5, (total,), generator=generator).numpy()
    counts = Documents(per_token, ids.starts, ids.lengths)
    config = SimpleNamespace(train=SimpleNamespace(seq_len=16, eval_rows=5),
                             data=SimpleNamespace(seed=3, packing=packing))
    found = validation_set(ids, 16, 5, rows_per_micro_batch=2, micro_batches=2, dp_size=1, seed=3,
                           packing=packing)
    targets = torch.cat([row.labels[row.labels != IGNORE_INDEX] for step in found.steps for row in step])
    assert 0 < targets.numel() < total   # a part of the split, cut
    expected = int(np.asarray(per_token)[targets.numpy()].sum())
    assert validation_text_bytes(SimpleNamespace(val=ids, val_token_bytes=counts), config) == expected
