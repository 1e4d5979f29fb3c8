"""A disk that fills while a checkpoint is written: one line naming the path, the space a checkpoint
takes and what is free, exit status 4; the partial checkpoint removed; the earlier checkpoint, the
metrics and the loss plot intact; `--resume auto` continues from the earlier checkpoint. (The fault
drill, tools/fault_drill.py, fills a real tmpfs; here the file writer reports ENOSPC.)"""
import errno

import pytest
from torch.distributed.checkpoint import FileSystemWriter

from gdn_parallel.checkpoint import latest_checkpoint
from gdn_parallel.checkpoint.loading import verify
from gdn_parallel.train.__main__ import run

BASE = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2",
        "--set", "train.log_every=1", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1",
        "--set", "checkpoint.interval=2"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_during_a_save(tmp_path, monkeypatch, capsys, async_save):
    pytest.importorskip("matplotlib")
    write_data, saves = FileSystemWriter.write_data, []

    def fill_up_on_the_second_save(self, plan, planner):
        saves.append(1)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", fill_up_on_the_second_save)
    argv = ["--steps", "6", *BASE, "--set", f"train.out_dir={tmp_path}",
            "--set", f"checkpoint.async_save={str(async_save).lower()}"]
    with pytest.raises(SystemExit) as stop:
        run(argv)
    assert stop.value.code == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gdn-train: error: saving checkpoint "), err
    assert f"{tmp_path / 'checkpoints' / 'step_4'} failed" in err and "No space left on device" in err, err
    assert "A checkpoint takes about " in err and " GiB are free on that file system" in err, err
    assert f"the newest complete one is {tmp_path / 'checkpoints' / 'step_2'}" in err, err
    assert not list((tmp_path / "checkpoints").glob("*.partial"))
    assert (latest_checkpoint(str(tmp_path)).name == "step_2"
            and verify(tmp_path / "checkpoints" / "step_2") is None)
    assert (tmp_path / "loss.png").stat().st_size > 0 and not (tmp_path / "loss.png.partial").exists()
    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    assert run(["--resume", "auto", *argv])["start_step"] == 2
