"""Checkpoints and resume (CPU, fp32): a resumed run is the uninterrupted run, bit for bit under the same
layout; an interrupted save is never picked; SIGTERM saves and ends the run cleanly. Resuming under
another layout (DCP reshards on load): tests/checkpoint/test_layout_matrix.py (every layout's checkpoints
on one process) and test_journeys.py (a one-process checkpoint under dp2, tp2 and cp2)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gdn_parallel.checkpoint import latest_checkpoint, resolve_resume
from gdn_parallel.checkpoint import loading as checkpoint_loading
from gdn_parallel.checkpoint.files import COMPLETE, TRAINER_STATE
from gdn_parallel.config import ConfigError
from gdn_parallel.train.__main__ import run

REPO = Path(__file__).resolve().parents[2]
BASE = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2",
        "--set", "train.log_every=1", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1"]


def losses_by_step(out_dir: Path) -> dict:
    """step -> training loss from metrics.jsonl; a resumed process's records replace the earlier ones."""
    by_step = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            by_step[record["step"]] = record["loss"]
    return by_step


def checkpoint_tensors(path: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = tmp_path / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return torch.load(target, weights_only=False)


def train(out_dir: Path, steps: int, *extra: str, resume: str = None) -> dict:
    argv = ["--steps", str(steps), *BASE, "--set", f"train.out_dir={out_dir}", *extra]
    return run(argv + (["--resume", resume] if resume else []))


def test_resume_is_bit_exact_under_the_same_layout(tmp_path):
    """6 steps straight, against 3 steps + resume from the step-3 checkpoint + 3 more: the same losses
    and the same final parameters and optimizer state, bit for bit."""
    straight = tmp_path / "straight"
    train(straight, 6, "--set", "checkpoint.interval=3")
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_3", resumed / "checkpoints" / "step_3")
    with open(resumed / "metrics.jsonl", "w") as fh:  # what the interrupted run had logged
        for line in (straight / "metrics.jsonl").read_text().splitlines():
            if json.loads(line).get("step", 99) < 3 and "summary" not in json.loads(line):
                fh.write(line + "\n")
    summary = train(resumed, 6, "--set", "checkpoint.interval=3", resume="auto")
    assert summary["start_step"] == 3
    assert losses_by_step(resumed) == losses_by_step(straight)          # exact floats, every step 0..5
    final_straight = checkpoint_tensors(straight / "checkpoints" / "step_6", tmp_path)
    final_resumed = checkpoint_tensors(resumed / "checkpoints" / "step_6", tmp_path)
    assert final_straight.keys() == final_resumed.keys()
    for name, value in final_straight.items():
        assert torch.equal(value, final_resumed[name]), name


def test_an_interrupted_save_is_never_picked(tmp_path, monkeypatch):
    # Directories that only look like checkpoints: what is tested is the completeness marker.
    monkeypatch.setattr(checkpoint_loading, "_small_files_problem", lambda path, unverified_ok=False: None)
    root = tmp_path / "checkpoints"
    for name, complete in (("step_2", True), ("step_4", False), ("step_6.partial", False)):
        (root / name).mkdir(parents=True)
        (root / name / TRAINER_STATE).write_text("{}")
        if complete:
            (root / name / COMPLETE).write_text("")
    assert latest_checkpoint(str(tmp_path)) == root / "step_2"
    assert resolve_resume("auto", str(tmp_path)) == root / "step_2"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resolve_resume(str(root / "step_4"), str(tmp_path))
    assert resolve_resume("auto", str(tmp_path / "elsewhere")) is None  # a first run: nothing yet


def test_a_checkpoint_of_another_model_is_refused_naming_the_fields(tmp_path, capsys):
    train(tmp_path, 2)
    with pytest.raises(SystemExit) as info:
        train(tmp_path, 4, "--set", "model.hidden_size=64", resume="auto")
    assert info.value.code == 2
    assert "model.hidden_size: checkpoint 128, config 64" in capsys.readouterr().err


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "gdn_parallel.train", "--steps", "400", *BASE, "--set",
           f"train.out_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, deadline = [], time.time() + 240
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            proc.send_signal(signal.SIGTERM)
        if time.time() > deadline:
            proc.kill()
            break
    assert proc.wait(timeout=60) == 0, "".join(lines[-30:])
    output = "".join(lines)
    assert "stop  |" in output and "save  |" in output, output[-2000:]
    saved = latest_checkpoint(str(tmp_path))
    step = int(saved.name.split("_")[1])
    assert 3 <= step < 400
    assert json.loads((saved / TRAINER_STATE).read_text())["step"] == step


def test_a_rollback_sets_the_abandoned_line_aside_and_keeps_the_new_one(tmp_path, capsys):
    """Resuming an older checkpoint into the run's own out_dir (keep=1): the later checkpoints of the
    abandoned line are moved to checkpoints/abandoned/<time>/ and named; the new line's step_4 is
    kept (it used to be pruned at once in favour of the abandoned, higher-numbered step_6, which a
    later `--resume auto` then loaded, ending after 0 steps), and `--resume auto` continues it."""
    # A constant LR: the lines end at other train.steps than the run they resume without changing its
    # schedule.
    constant = ("--set", "train.lr_schedule=constant")
    train(tmp_path, 6, "--set", "checkpoint.interval=2", *constant)             # step_2, step_4, step_6
    capsys.readouterr()
    step_2 = tmp_path / "checkpoints" / "step_2"
    summary = train(tmp_path, 4, "--set", "checkpoint.interval=2", "--set", "checkpoint.keep=1", *constant,
                    resume=str(step_2))
    assert summary["start_step"] == 2 and summary["steps"] == 4
    printed = capsys.readouterr().out
    abandoned = sorted((tmp_path / "checkpoints" / "abandoned").glob("*/step_*"))
    assert [path.name for path in abandoned] == ["step_4", "step_6"]
    assert f"rolled back to step 2: the later checkpoint(s) step_4, step_6 of the abandoned line moved to " \
           f"{abandoned[0].parent}" in printed
    assert [path.name for path in (tmp_path / "checkpoints").glob("step_*")] == ["step_4"]
    later = train(tmp_path, 5, "--set", "checkpoint.interval=2", "--set", "checkpoint.keep=1", *constant,
                  resume="auto")
    assert later["start_step"] == 4 and later["steps"] == 5


def test_a_rolled_back_line_repeats_the_abandoned_one_bit_for_bit(tmp_path):
    """The new line's checkpoint at a step the abandoned line also reached holds the same tensors."""
    train(tmp_path, 4, "--set", "checkpoint.interval=2")                         # step_2, step_4
    train(tmp_path, 4, "--set", "checkpoint.interval=2", resume=str(tmp_path / "checkpoints" / "step_2"))
    (abandoned,) = (tmp_path / "checkpoints" / "abandoned").glob("*/step_4")
    new, old = (checkpoint_tensors(path, tmp_path)
                for path in (tmp_path / "checkpoints" / "step_4", abandoned))
    assert new.keys() == old.keys() and all(torch.equal(new[key], old[key]) for key in new)
