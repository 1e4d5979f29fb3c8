"""Inputs a run cannot use are refused before training, in one line that names the field and the fix
(exit status 2), instead of training on something else than asked."""
import os

import pytest

from gdn_parallel.train.__main__ import run

BASE = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2",
        "--set", "train.log_every=1", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1"]


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        run(["--steps", "2", *BASE, *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err, err
    return err


def test_a_corpus_smaller_than_one_step(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("abc")
    err = refused(capsys, "--set", f"data.source={tmp_path / 'tiny.txt'}", "--set", "data.val_fraction=0")
    assert "has 3 training tokens; one optimizer step takes parallel.dp x train.batch_size x " \
           "train.seq_len = 1 x 2 x 64 = 128" in err, err


def test_a_sequence_longer_than_the_corpus_is_refused_before_memory_grows(capsys):
    err = refused(capsys, "--set", "train.seq_len=100000000")
    assert "training tokens; one optimizer step takes" in err and "lower train.seq_len" in err, err


def test_a_resume_at_the_last_step(tmp_path, capsys):
    run(["--steps", "2", *BASE, "--set", f"train.out_dir={tmp_path}"])
    capsys.readouterr()
    err = refused(capsys, "--set", f"train.out_dir={tmp_path}", "--resume", "auto")
    assert ("is at step 2 and train.steps=2: nothing is left to train; raise train.steps (e.g. --steps 1002, "
            "with --set train.schedule_override=true") in err


def test_a_new_run_into_an_out_dir_holding_another_run(tmp_path, capsys):
    run(["--steps", "2", *BASE, "--set", f"train.out_dir={tmp_path}"])
    capsys.readouterr()
    err = refused(capsys, "--set", f"train.out_dir={tmp_path}")
    assert "already holds checkpoints (newest step_2); continue that run with --resume auto, or start " \
           "over in a new train.out_dir" in err, err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_an_out_dir_that_cannot_be_written(capsys):
    err = refused(capsys, "--set", "train.out_dir=/proc/x")
    assert "train.out_dir='/proc/x' cannot be written" in err, err
