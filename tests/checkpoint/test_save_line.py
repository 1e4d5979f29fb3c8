"""The trainer's `save  |` line and metrics record name the checkpoint the saver publishes (the path
CheckpointSaver.save returns), synchronously and in the background; the wait for the last background
save is said."""
import json
import re

import pytest

from gdn_parallel.train.__main__ import run

BASE = ["--steps", "3", "--set", "model.n_layers=2", "--set", "train.seq_len=64",
        "--set", "train.batch_size=2", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1",
        "--set", "checkpoint.interval=2"]


@pytest.mark.parametrize("async_save", [False, True])
def test_the_save_line_names_the_published_checkpoint(tmp_path, capsys, async_save):
    run([*BASE, "--set", f"train.out_dir={tmp_path}",
         "--set", f"checkpoint.async_save={str(async_save).lower()}"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("save  | ")]
    checkpoints = tmp_path / "checkpoints"
    background = " (writing in the background)" if async_save else ""
    # checkpoint.interval=2: after step 1 (2 steps done), and after the last step (3 done); a background
    # save is then waited for, and the wait said
    assert lines[:2] == [f"save  | {checkpoints / 'step_2'}{background}",
                         f"save  | {checkpoints / 'step_3'}{background}"]
    assert len(lines) == 2 + async_save
    if async_save:
        assert re.fullmatch(r"save  \| the last checkpoint written \d+\.\d s after the run's end", lines[2])
    assert (checkpoints / "step_2" / "COMPLETE").is_file() and (checkpoints / "step_3" / "COMPLETE").is_file()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saved = [(r["step"], r["checkpoint"]) for r in records if "checkpoint" in r]
    assert saved == [(1, str(checkpoints / "step_2")), (2, str(checkpoints / "step_3"))]


def test_a_background_save_of_one_process_runs_on_a_gloo_group(tmp_path, monkeypatch):
    """DCP refuses a background save on a group without a CPU backend; a one-GPU run's default group is
    NCCL alone ("A CPU backend must be enabled for async save", seen on an H100), so even one process
    hands DCP a gloo group of its own."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    groups = []
    real = dcp.async_save

    def recording(state, **kwargs):
        group = kwargs.get("process_group")
        groups.append(None if group is None else dist.get_backend(group))
        return real(state, **kwargs)
    monkeypatch.setattr(dcp, "async_save", recording)
    run([*BASE, "--set", f"train.out_dir={tmp_path}", "--set", "checkpoint.async_save=true"])
    assert groups == ["gloo", "gloo"]
