"""The trainer's last silent cases and raw tracebacks (issue 44, item 4): each is a one-line error naming
the field and the fix (exit status 2), or, where the input is accepted, a line on stdout saying what
was made of it. No step is trained here."""
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from gdn_parallel.config import Config, ConfigError, TrainConfig
from gdn_parallel.train import run_setup
from gdn_parallel.train.__main__ import build_parser, load_config, main, run
from gdn_parallel.train.run_state import ModelSize
from gdn_parallel.train.schedule import lr_at

SMALL = ["--steps", "2", "--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set",
         "train.batch_size=2", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1"]


def refused(capsys, argv) -> str:
    """The command's error line on stderr (after the usage, for a config refused while it is parsed),
    after exit status 2 and no traceback."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    last = err.rstrip("\n").splitlines()[-1]
    assert stop.value.code == 2 and "Traceback" not in err and last.startswith("gdn-train: error: "), err
    return last


# --- 1. model.attn_impl=flex on the CPU: refused at start-up, before the data and the model ----------

def test_flex_attention_on_the_cpu_is_refused_before_data_or_model(capsys, monkeypatch):
    def too_late(*args, **kwargs):
        raise AssertionError("the data was read: flex on the CPU was not refused at start-up")
    monkeypatch.setattr(run_setup, "_checked_dataset", too_late)
    err = refused(capsys, [*SMALL, "--set", "train.device=cpu", "--set", "model.attn_impl=flex"])
    assert "model.attn_impl='flex' cannot train on the CPU" in err and "model.attn_impl=sdpa" in err, err


# --- 4. the warmup and the LR schedule at its end ------------------------------------------------------

@pytest.mark.parametrize("steps, warmup", [(10, 1), (20, 2)])   # shorter than tiny-cpu's 20; as long
def test_a_shortened_warmup_is_the_runs_first_line_on_stdout(steps, warmup, capsys):
    config = load_config(build_parser().parse_args(["--steps", str(steps)]))
    assert (config.train.steps, config.train.warmup_steps) == (steps, warmup)
    out = capsys.readouterr().out
    assert out.startswith(f"note  | train.warmup_steps=20 of the config does not fit train.steps={steps} "
                          f"set on the command line"), out
    assert f"shortened to {warmup} update(s)" in out and "--set train.warmup_steps=N" in out, out


def test_print_config_keeps_stdout_a_config_file_and_notes_on_stderr(capsys):
    with pytest.raises(SystemExit) as stop:
        run(["--steps", "5", "--print-config"])
    captured = capsys.readouterr()
    assert stop.value.code == 0 and "note  | train.warmup_steps=20" in captured.err
    assert Config.from_dict(yaml.safe_load(captured.out)).train.warmup_steps == 0


def cosine(steps: int, warmup: int) -> TrainConfig:
    return TrainConfig(lr=1.0, min_lr_ratio=0.1, steps=steps, warmup_steps=warmup, lr_schedule="cosine")


@pytest.mark.parametrize("steps, warmup", [(1, 0), (2, 1), (11, 10), (2, 0), (12, 10)])
def test_the_cosine_schedule_ends_at_min_lr_however_short(steps, warmup):
    train = cosine(steps, warmup)
    train.validate()
    lrs = [lr_at(step, train) for step in range(steps)]
    assert lrs[-1] == pytest.approx(0.1)                                   # the last update: min_lr
    assert lrs[:warmup] == pytest.approx([(step + 1) / warmup for step in range(warmup)])
    assert all(math.isfinite(lr) and 0.1 - 1e-12 <= lr <= 1.0 for lr in lrs)


def test_a_cosine_warmup_as_long_as_the_run_is_refused_naming_the_fields():
    with pytest.raises(ConfigError, match=r"warmup_steps=10 fills all train.steps=10.*below train.steps"):
        cosine(10, 10).validate()
    TrainConfig(steps=10, warmup_steps=10, lr_schedule="constant").validate()   # constant: nothing to decay


# --- 5. an uneven pipeline split is said at start-up -------------------------------------------------

def announced(monkeypatch, n_layers: int, pattern: str) -> list[str]:
    """The start-up lines of a pp=2 run of `n_layers` layers (rank 0 of a 2-process job)."""
    config = Config.from_dict({"model": {"n_layers": n_layers, "layer_pattern": pattern},
                               "parallel": {"pp": 2}})
    lines = []
    fake_run = SimpleNamespace(config=config, say=lines.append, size=ModelSize(1, 1.0),
                               device=torch.device("cpu"))
    monkeypatch.setattr(run_setup.dist, "get_world_size", lambda: 2)
    run_setup._announce(fake_run, SimpleNamespace(describe=lambda: "data"))
    return lines


def test_an_uneven_pipeline_split_is_one_start_up_line(monkeypatch):
    lines = announced(monkeypatch, 3, "GSG")
    split = [line for line in lines if line.startswith("pipe  |")]
    assert len(split) == 1 and "model.n_layers=3 over 2 stages, unevenly" in split[0], lines
    assert split[0].endswith(": stage 0: layers 0-1, stage 1: layer 2"), split
    assert not [line for line in announced(monkeypatch, 4, "GS") if line.startswith("pipe")]


# --- 7. a data.source or --config that is no file says what it is --------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_device_as_data_source_is_named_for_what_it_is(capsys):
    err = refused(capsys, [*SMALL, "--set", "data.source=/dev/zero"])
    assert "data.source='/dev/zero' is a character device, not a regular file: give 'stdlib'" in err, err


def test_a_pipe_as_data_source_is_named_for_what_it_is(tmp_path, capsys):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    err = refused(capsys, [*SMALL, "--set", f"data.source={pipe}"])
    assert "is a named pipe (FIFO), not a regular file" in err, err


def test_a_directory_as_config_is_named_for_what_it_is(tmp_path, capsys):
    err = refused(capsys, ["--config", str(tmp_path)])
    assert f"config file {str(tmp_path)!r} is a directory, not a file: give a YAML file" in err, err
    err = refused(capsys, ["--config", str(Path(tmp_path) / "missing.yaml")])
    assert "does not exist" in err, err
