"""A step with a non-finite loss or gradient is skipped (nothing applied) and counted; too many in a
row stop the run with a clear message. Checkpoints: asynchronous saves are published, old ones pruned."""
import json
import math

import pytest
import torch

from gdn_parallel.checkpoint import complete_checkpoints
from gdn_parallel.parallel.parallelize import ParallelModel
from gdn_parallel.train.__main__ import run

BASE = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2",
        "--set", "train.log_every=1", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1"]
# A 2-step and a 3-step run compared step for step: a learning rate that does not read train.steps
# (cosine gives the 2-step run's last update min_lr, the 3-step run's the peak)
SAME_LR = ["--set", "train.lr_schedule=constant"]


def poison_steps(monkeypatch, bad: set):
    """ParallelModel.train_step returns a NaN loss at the given (0-based) calls."""
    original = ParallelModel.train_step
    calls = []

    def train_step(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        calls.append(len(calls))
        return loss * math.nan if calls[-1] in bad else loss
    monkeypatch.setattr(ParallelModel, "train_step", train_step)


def parameters_after(out_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = complete_checkpoints(str(out_dir))[-1]
    dcp_to_torch_save(str(path), str(out_dir / "final.pt"))
    return {k: v for k, v in torch.load(out_dir / "final.pt", weights_only=False).items()
            if k.startswith("model.")}


def test_a_non_finite_step_is_skipped_and_changes_nothing(tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    run(["--steps", "2", *BASE, *SAME_LR, "--set", f"train.out_dir={clean}"])
    poisoned = tmp_path / "poisoned"
    poison_steps(monkeypatch, {2})  # a third step that is skipped: the weights stay those after two
    summary = run(["--steps", "3", *BASE, *SAME_LR, "--set", f"train.out_dir={poisoned}", "--set",
                   "train.warmup_steps=1"])
    assert summary["steps"] == 3
    records = [json.loads(line) for line in (poisoned / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("skipped_step") and r["step"] == 2 for r in records)
    # the same learning rate at steps 0 and 1 in both runs (SAME_LR): the same weights
    before, after = parameters_after(clean), parameters_after(poisoned)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name


def test_too_many_non_finite_steps_in_a_row_stop_the_run(tmp_path, monkeypatch, capsys):
    """The stop is one line on stderr and exit status 3, no traceback."""
    poison_steps(monkeypatch, {1, 2})
    with pytest.raises(SystemExit) as stop:
        run(["--steps", "5", *BASE, "--set", f"train.out_dir={tmp_path}", "--set",
             "train.max_skipped_steps=2"])
    assert stop.value.code == 3
    err = capsys.readouterr().err
    assert (err.startswith("gdn-train: error: stopped: 2 steps in a row had a non-finite loss")
            and err.count("\n") == 1)


def test_asynchronous_saves_are_published_and_old_ones_pruned(tmp_path):
    run(["--steps", "6", *BASE, "--set", f"train.out_dir={tmp_path}", "--set", "checkpoint.interval=2",
         "--set", "checkpoint.async_save=true", "--set", "checkpoint.keep=2"])
    assert [p.name for p in complete_checkpoints(str(tmp_path))] == ["step_4", "step_6"]
    assert not list((tmp_path / "checkpoints").glob("*.partial"))
