"""tools/eval_niah.py and the passkey task: samples are exact to the token for any tokenizer, the
scoring reads the answer from the right positions (a perfect predictor scores 1, one shifted by a
token 0), needles are placed on the CP rank their position says, and the command runs end to end on
a checkpoint trained on the task's own data."""
import json
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from gdn_parallel.data.passkey import FILLER, KEY_DIGITS, NEEDLE, QUESTION, PasskeyTask, documents
from gdn_parallel.data.text_tokenizer import ByteTokenizer
from gdn_parallel.train.__main__ import run
from tools.eval_niah import answer_hits, by_rank_summary, main, needle_rank, score_grid

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def text_of(ids) -> str:
    return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8")


@pytest.mark.parametrize("length, depth", [(138, 0.0), (200, 0.0), (300, 0.37), (1000, 1.0), (4096, 0.5)])
def test_a_sample_is_length_tokens_with_the_needle_at_its_depth(length, depth):
    task = PasskeyTask(ByteTokenizer())
    sample = task.sample(length, depth, random.Random(length))
    assert sample.length == length and len(sample.key) == KEY_DIGITS and sample.key.isdigit()
    assert text_of(sample.ids[sample.answer_start:]) == sample.key
    assert text_of(sample.ids[sample.needle_start:sample.needle_end]) == NEEDLE.format(key=sample.key)
    assert text_of(sample.ids[sample.answer_start - len(QUESTION):sample.answer_start]) == QUESTION
    filler_len = length - (sample.needle_end - sample.needle_start) - len(QUESTION) - KEY_DIGITS
    assert sample.needle_start == round(depth * filler_len)
    # the key appears only in the needle and the answer; the filler has no digit at all
    assert text_of(sample.ids).count(sample.key) == 2 and not any(c.isdigit() for c in FILLER)


def test_too_short_or_bad_depth_is_refused():
    task = PasskeyTask(ByteTokenizer())
    with pytest.raises(ValueError, match="shorter than the task"):
        task.sample(task.min_length() - 1, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        task.sample(500, 1.5, random.Random(0))


def test_grid_cells_keep_their_samples_whatever_the_grid():
    task = PasskeyTask(ByteTokenizer())
    alone = task.grid([300], [0.5], 3, seed=7)
    among = task.grid([200, 300], [0.0, 0.5], 3, seed=7)
    assert [s.key for s in alone] == [s.key for s in among if s.length == 300 and s.depth == 0.5]
    assert len({s.key for s in among}) > 1


def test_samples_with_a_subword_tokenizer_are_exact():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([FILLER, NEEDLE, QUESTION, "0123456789"] * 10,
                            tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))

    class Encoder:
        def encode_batch(self, texts):
            return [np.asarray(e.ids) for e in tok.encode_batch(texts)]

    task = PasskeyTask(Encoder())
    sample = task.sample(120, 0.5, random.Random(3))
    assert sample.length == 120
    assert tok.decode(sample.ids[sample.answer_start:].tolist()).replace(" ", "") == sample.key


def test_training_documents_are_samples_of_the_given_lengths():
    texts = documents(20, 150, 400, seed=1)
    assert len(texts) == 20 and all(150 <= len(t.encode()) <= 400 for t in texts)
    for text in texts:
        key = text[-KEY_DIGITS:]
        assert key.isdigit() and text[:-KEY_DIGITS].endswith(QUESTION) and NEEDLE.format(key=key) in text
    assert texts == documents(20, 150, 400, seed=1) and texts != documents(20, 150, 400, seed=2)


@dataclass
class Out:
    logits: torch.Tensor


class NextTokenOracle(torch.nn.Module):
    """Logits that put the top score on the true next token (shift=1), or on another one."""

    def __init__(self, shift=1, wrong_at=None):
        super().__init__()
        self.shift, self.wrong_at = shift, wrong_at

    def forward(self, ids):
        target = torch.roll(ids, -self.shift, dims=1)
        if self.wrong_at is not None:
            target[:, self.wrong_at] = (target[:, self.wrong_at] + 1) % 256
        return Out(torch.nn.functional.one_hot(target, 256).float())


def test_scoring_reads_the_answer_positions():
    task = PasskeyTask(ByteTokenizer())
    samples = task.grid([300], [0.5], 4, seed=0)
    device = torch.device("cpu")
    assert answer_hits(NextTokenOracle(), samples, device, None).all()
    assert not answer_hits(NextTokenOracle(shift=0), samples, device, None)[:, 0].any()
    one_wrong = answer_hits(NextTokenOracle(wrong_at=300 - KEY_DIGITS - 1 + 3), samples, device, None)
    assert one_wrong.sum(1).tolist() == [KEY_DIGITS - 1] * 4 and not one_wrong[:, 3].any()
    cells = score_grid(NextTokenOracle(wrong_at=300 - KEY_DIGITS - 1), task, [300], [0.0, 1.0], 2, 0, 2, 3,
                       device, None)
    assert [c["accuracy"] for c in cells] == [0.0, 0.0]
    assert [c["digit_accuracy"] for c in cells] == [pytest.approx(1 - 1 / KEY_DIGITS)] * 2


def test_needles_are_counted_on_the_rank_their_position_falls_on():
    task = PasskeyTask(ByteTokenizer())
    first, last = task.sample(400, 0.0, random.Random(0)), task.sample(400, 1.0, random.Random(0))
    assert (needle_rank(first, 2), needle_rank(last, 2)) == (0, 1)
    assert needle_rank(task.sample(400, 0.5, random.Random(0)), 4) == 1
    cells = score_grid(NextTokenOracle(), task, [400], [0.0, 1.0], 3, 0, 2, 4, torch.device("cpu"), None)
    summary = by_rank_summary(cells, 2)
    assert summary == {"same rank as the question": {"samples": 3, "accuracy": 1.0},
                       "another rank": {"samples": 3, "accuracy": 1.0}}


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("passkey")
    assert main(["make-data", "--out", str(root / "data"), "--docs", "40", "--min-length", "140",
                 "--max-length", "256"]) == 0
    run(["--steps", "2", "--set", f"data.source={root / 'data'}", "--set", "train.seq_len=256",
         "--set", "train.batch_size=1", "--set", "train.warmup_steps=0", "--set", "train.eval_rows=2",
         "--set", "model.hidden_size=32", "--set", "model.gdn_head_dim=8", "--set", "data.val_fraction=0.2",
         "--set", f"train.out_dir={root / 'run'}"])
    return root


def test_eval_writes_the_grid_by_rank_and_position(passkey_run, capsys):
    pytest.importorskip("matplotlib")
    out = passkey_run / "eval"
    assert main(["eval", str(passkey_run / "run"), "--lengths", "160,320", "--depths", "0,0.5,1",
                 "--samples", "2", "--batch", "4", "--cp", "2", "--out", str(out)]) == 0
    result = json.loads((out / "niah.json").read_text())
    assert [(c["length"], c["depth"]) for c in result["cells"]] == \
        [(n, d) for n in (160, 320) for d in (0, 0.5, 1)]
    assert all(c["samples"] == 2 and 0.0 <= c["accuracy"] <= c["digit_accuracy"] <= 1.0
               for c in result["cells"])
    assert sum(v["samples"] for v in result["accuracy_by_needle_rank"].values()) == 12
    assert set(result["loss_by_position"]) <= {"0-64", "64-256", "256-320"} and result["loss_by_position"]
    assert (out / "niah.png").read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "depth \\ length" in printed and "cp=2 needle on another rank" in printed


@pytest.mark.parametrize("args, message", [
    (["--cp", "3"], "--cp 3 must be >= 1 and divide every length"),
    (["--lengths", "100"], "shorter than the task"),
    (["--lengths", "a,b"], "comma-separated list"),
])
def test_eval_refuses_bad_arguments(passkey_run, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["eval", str(passkey_run / "run"), "--lengths", "160,320", "--no-plot", *args])


def test_make_data_refuses_a_used_directory(passkey_run):
    with pytest.raises(SystemExit, match="not empty"):
        main(["make-data", "--out", str(passkey_run / "data")])
