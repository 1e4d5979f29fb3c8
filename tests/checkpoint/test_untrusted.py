"""Checkpoints from elsewhere: resuming never runs code from them, and damage is named, never half-read.

A pickle whose unpickling would create a marker file is planted in each file a checkpoint holds; the
checksums are then rewritten to match (as whoever planted it could), or removed (a checkpoint from
before checksums, loaded with checkpoint.verify=false). Every resume is refused with the file named,
and the marker never appears. Without checksums and without that flag, the checkpoint is refused
before any of its files is read.
Damage without forgery (flipped bytes, truncation, a missing file) fails verification naming the
file; `--resume auto` passes over such a checkpoint, saying so, and takes the newest that verifies.
"""
import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from gdn_parallel.checkpoint import integrity
from gdn_parallel.checkpoint.files import TRAINER_STATE
from gdn_parallel.train.__main__ import run

BASE = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "train.batch_size=2",
        "--set", "train.log_every=1", "--set", "train.eval_rows=2", "--set", "train.warmup_steps=1",
        "--set", "train.lr_schedule=constant"]   # reads no train.steps: resumes may end at other steps


class Planted:
    """Unpickling this creates the file `marker` (it would be any code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def train(out_dir: Path, steps: int, *extra: str, resume: str = None) -> dict:
    argv = ["--steps", str(steps), *BASE, "--set", f"train.out_dir={out_dir}", *extra]
    return run(argv + (["--resume", resume] if resume else []))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run with checkpoints at steps 2 and 4."""
    out_dir = tmp_path_factory.mktemp("saved")
    train(out_dir, 4, "--set", "checkpoint.interval=2")
    return out_dir


def copy_run(saved: Path, tmp_path: Path) -> Path:
    out_dir = tmp_path / "run"
    shutil.copytree(saved, out_dir)
    return out_dir


UNVERIFIED = ("--set", "checkpoint.verify=false")


def refused(capsys, out_dir: Path, resume: str, steps: int = 6, *extra: str) -> str:
    with warnings.catch_warnings(record=True) as warned, pytest.raises(SystemExit) as stop:
        warnings.simplefilter("always")
        train(out_dir, steps, *extra, resume=resume)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gdn-train: error: ") and err.count("\n") == 1, err   # one line, no traceback
    # A warning would reach the user's stderr beside the line (pytest keeps warnings off capsys).
    assert not [str(w.message) for w in warned if "pickle" in str(w.message)], err
    return err


def reseal(checkpoint: Path) -> None:
    """Rewrite checksums.json to match the files as they are now (what a forger would do)."""
    recorded = integrity.read_manifest(checkpoint)
    integrity.write_manifest(checkpoint, integrity.checksums(checkpoint, sorted(recorded)))


@pytest.mark.parametrize("manifest", ["forged", "absent"])
@pytest.mark.parametrize("victim", [".metadata", "rng_rank0.pt", "__0_0.distcp", TRAINER_STATE])
def test_a_planted_pickle_is_refused_naming_the_file_and_never_runs(saved, tmp_path, capsys, victim,
                                                                    manifest):
    out_dir = copy_run(saved, tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    marker = tmp_path / "code-ran"
    if victim == "rng_rank0.pt":   # torch.save's format, as the real file has
        torch.save({"torch": torch.get_rng_state(), "python": Planted(marker)}, checkpoint / victim)
    else:
        (checkpoint / victim).write_bytes(pickle.dumps(Planted(marker)))
    flags = ()
    if manifest == "forged":
        reseal(checkpoint)
    else:
        (checkpoint / integrity.MANIFEST).unlink()
        flags = UNVERIFIED
    err = refused(capsys, out_dir, str(checkpoint), 6, *flags)
    assert not marker.exists(), "code from the checkpoint ran"
    assert str(checkpoint) in err and victim in err, err
    # --resume auto passes over it, saying so, to the older checkpoint; still nothing runs.
    summary = train(out_dir, 5, *flags, resume="auto")
    assert summary["start_step"] == 2 and not marker.exists()
    printed = capsys.readouterr().out
    assert f"resume | {checkpoint} fails verification (" in printed and victim in printed, printed


def flip_bytes(path: Path, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(count):
        data[middle + i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped": lambda p: flip_bytes(p / "__0_0.distcp"),
    "truncated": lambda p: (p / "__0_0.distcp").write_bytes((p / "__0_0.distcp").read_bytes()[:1000]),
    "missing": lambda p: (p / "rng_rank0.pt").unlink(),
    "torn state": lambda p: (p / TRAINER_STATE).write_text((p / TRAINER_STATE).read_text()[:50]),
    "torn index": lambda p: (p / ".metadata").write_bytes((p / ".metadata").read_bytes()[:100]),
    "torn checksums": lambda p: (p / integrity.MANIFEST).write_text("{"),
}
EXPECTED = {"flipped": "__0_0.distcp: checksum mismatch", "truncated": "__0_0.distcp: 1000 bytes",
            "missing": "rng_rank0.pt: missing", "torn state": f"{TRAINER_STATE}: ",
            "torn index": ".metadata: ", "torn checksums": "checksums.json cannot be read"}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_named_and_resume_auto_takes_the_newest_checkpoint_that_verifies(saved, tmp_path, capsys,
                                                                                   kind):
    out_dir = copy_run(saved, tmp_path)
    damaged = out_dir / "checkpoints" / "step_4"
    DAMAGE[kind](damaged)
    err = refused(capsys, out_dir, str(damaged))
    assert f"{damaged} fails verification" in err and EXPECTED[kind] in err, err
    assert f"the newest earlier checkpoint that verifies is {out_dir / 'checkpoints' / 'step_2'}" in err, err
    summary = train(out_dir, 5, resume="auto")
    assert summary["start_step"] == 2
    printed = capsys.readouterr().out
    assert f"resume | {damaged} fails verification (" in printed and "passed over" in printed, printed


def test_a_checkpoint_whose_checksums_all_fail_is_not_resumed(saved, tmp_path, capsys):
    out_dir = copy_run(saved, tmp_path)
    for step in (2, 4):
        flip_bytes(out_dir / "checkpoints" / f"step_{step}" / "__0_0.distcp")
    err = refused(capsys, out_dir, "auto")
    assert "none of the 2 checkpoint(s)" in err and "verifies" in err, err


def test_checksums_are_recorded_for_every_file(saved):
    checkpoint = saved / "checkpoints" / "step_4"
    recorded = integrity.read_manifest(checkpoint)
    on_disk = {p.name for p in checkpoint.iterdir()} - {integrity.MANIFEST, "COMPLETE"}
    assert (set(recorded) == on_disk
            and {".metadata", "__0_0.distcp", "rng_rank0.pt", TRAINER_STATE} <= on_disk)
    assert json.loads((checkpoint / integrity.MANIFEST).read_text())["version"] == integrity.MANIFEST_VERSION


def plant_in_rng(checkpoint: Path, marker: Path) -> None:
    torch.save({"torch": torch.get_rng_state(), "python": Planted(marker)}, checkpoint / "rng_rank0.pt")
    reseal(checkpoint)


def plant_in_data(checkpoint: Path, marker: Path) -> None:
    (checkpoint / "__0_0.distcp").write_bytes(pickle.dumps(Planted(marker)))
    reseal(checkpoint)


AT_THE_END = {  # damage -> the file a refusal must name
    "flipped": (lambda checkpoint, marker: flip_bytes(checkpoint / "__0_0.distcp"),
                "__0_0.distcp: checksum mismatch"),
    "planted rng": (plant_in_rng, "rng_rank0.pt"),
    "planted data": (plant_in_data, "__0_0.distcp"),
}


@pytest.mark.parametrize("kind", list(AT_THE_END))
def test_a_damaged_checkpoint_at_train_steps_does_not_pass_for_the_finished_run(saved, tmp_path, capsys,
                                                                                 kind):
    """The finished run's own command again (train.steps = the newest checkpoint's step) where that
    checkpoint is damaged: `--resume auto` passes over it naming the file and trains again from the newest
    that verifies, to a final checkpoint that verifies; `--resume <it>` is refused naming the file. Before,
    both said "nothing is left to train" without reading its data (the fault drill: 7 of 11 kinds)."""
    out_dir = copy_run(saved, tmp_path)
    damaged = out_dir / "checkpoints" / "step_4"
    marker = tmp_path / "code-ran"
    damage, named = AT_THE_END[kind]
    damage(damaged, marker)
    err = refused(capsys, out_dir, str(damaged), steps=4)
    assert f"{damaged} fails verification" in err and named in err, err
    assert f"the newest earlier checkpoint that verifies is {out_dir / 'checkpoints' / 'step_2'}" in err, err
    summary = train(out_dir, 4, resume="auto")
    assert summary["start_step"] == 2 and not marker.exists()
    printed = capsys.readouterr().out
    assert f"resume | {damaged} fails verification (" in printed and named in printed, printed
    recorded = integrity.read_manifest(damaged)
    assert integrity.find_damage(damaged, sorted(recorded), recorded) == [], "the new final checkpoint"


def test_an_empty_rng_file_without_checksums_is_refused_in_one_line(saved, tmp_path, capsys):
    """torch.load of an empty file raises EOFError with no message: the refusal still names the file."""
    out_dir = copy_run(saved, tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    (checkpoint / "rng_rank0.pt").write_bytes(b"")
    (checkpoint / integrity.MANIFEST).unlink()   # a checkpoint from before checksums
    err = refused(capsys, out_dir, str(checkpoint), 6, *UNVERIFIED)
    assert "rng_rank0.pt is not an RNG state file that can be read safely (EOFError" in err, err


def test_a_checkpoint_without_checksums_is_refused_unless_the_user_accepts_it(saved, tmp_path, capsys):
    """Its files flipped where no checksum can see it: refused before anything is read, naming the flag;
    --resume auto passes over it to the newest that verifies; with checkpoint.verify=false it is loaded
    and a line says it was loaded unverified."""
    out_dir = copy_run(saved, tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    (checkpoint / integrity.MANIFEST).unlink()
    flip_bytes(checkpoint / "__0_0.distcp", 16)
    err = refused(capsys, out_dir, str(checkpoint))
    assert f"{checkpoint} fails verification: {checkpoint}/checksums.json: missing" in err, err
    assert "--set checkpoint.verify=false loads it unverified" in err, err
    summary = train(out_dir, 5, resume="auto")
    assert summary["start_step"] == 2
    assert f"resume | {checkpoint} fails verification (" in capsys.readouterr().out
    trusted = tmp_path / "trusted"
    shutil.copytree(saved, trusted)
    checkpoint = trusted / "checkpoints" / "step_4"
    (checkpoint / integrity.MANIFEST).unlink()
    summary = train(trusted, 5, *UNVERIFIED, resume=str(checkpoint))
    assert summary["start_step"] == 4
    assert f"resume | {checkpoint} has no checksums.json: loaded unverified" in capsys.readouterr().out


def test_resume_auto_names_every_newer_step_directory_it_passes_over(saved, tmp_path, capsys):
    out_dir = copy_run(saved, tmp_path)
    (out_dir / "checkpoints" / "step_4" / "COMPLETE").unlink()
    summary = train(out_dir, 5, resume="auto")
    assert summary["start_step"] == 2
    printed = capsys.readouterr().out
    assert (f"resume | {out_dir / 'checkpoints' / 'step_4'} is not a complete checkpoint (no COMPLETE: "
            f"an interrupted save, or a file deleted): passed over") in printed, printed


def test_the_converters_refuse_a_checkpoint_without_checksums_saying_how_to_get_them(saved, tmp_path, capsys):
    from gdn_parallel.convert.__main__ import main as convert
    out_dir = copy_run(saved, tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    (checkpoint / integrity.MANIFEST).unlink()
    assert convert(["to-torch", str(checkpoint), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err
    assert f"{checkpoint} fails verification: checksums.json: missing" in err, err
    assert "--set checkpoint.verify=false" in err, err
    assert not (tmp_path / "model.pt").exists()


def test_a_checkpoint_holding_non_finite_values_is_refused_naming_it(saved, tmp_path, capsys):
    """Damage the checksums would have caught, let through with checkpoint.verify=false (16 bytes of a
    data file set to 0xFF: NaNs): refused once loaded (status 2), naming the checkpoint; no checkpoint
    written. (Flipped bits that stay finite are met at the first save instead: the next test.)"""
    out_dir = copy_run(saved, tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    (checkpoint / integrity.MANIFEST).unlink()
    data = bytearray((checkpoint / "__0_0.distcp").read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = b"\xff" * 16
    (checkpoint / "__0_0.distcp").write_bytes(bytes(data))
    err = refused(capsys, out_dir, str(checkpoint), 6, *UNVERIFIED)
    assert f"{checkpoint} holds parameters or optimizer moments that are not finite" in err, err
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_a_resume_whose_first_step_is_not_finite_stops_naming_the_checkpoint(saved, tmp_path, capsys,
                                                                              monkeypatch):
    """A finite state whose first step is not (here: the loss made NaN at that step) stops the run
    (status 3) naming the checkpoint, without a checkpoint."""
    from gdn_parallel.train import trainer
    original = trainer._optimizer_step

    def nan_loss(run, step):
        if step == run.start_step:
            with torch.no_grad():
                next(iter(run.parallel.parameters())).fill_(float("nan"))
        original(run, step)
    monkeypatch.setattr(trainer, "_optimizer_step", nan_loss)
    out_dir = copy_run(saved, tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    with pytest.raises(SystemExit) as stop:
        train(out_dir, 6, resume=str(checkpoint))
    assert stop.value.code == 3
    err = capsys.readouterr().err
    assert f"the first step after resuming {checkpoint} is not finite" in err, err
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_a_state_that_is_not_finite_is_never_saved(tmp_path, capsys, monkeypatch):
    """Parameters gone NaN without a non-finite loss (here: put there after step 1) stop the run at
    the save (status 3) instead of becoming a checkpoint."""
    from gdn_parallel.train import trainer
    original = trainer._optimizer_step

    def poisoned(run, step):
        original(run, step)
        if step == 1:
            with torch.no_grad():
                next(iter(run.parallel.parameters())).fill_(float("nan"))
    monkeypatch.setattr(trainer, "_optimizer_step", poisoned)
    with pytest.raises(SystemExit) as stop:
        train(tmp_path / "run", 4, "--set", "checkpoint.interval=2")
    assert stop.value.code == 3
    err = capsys.readouterr().err
    assert "after step 1 the parameters or optimizer moments are not finite: no checkpoint is written" in err
    saved_dirs = tmp_path / "run" / "checkpoints"
    assert not saved_dirs.exists() or not any(saved_dirs.iterdir())


def test_a_device_error_while_loading_is_not_called_damage(saved, tmp_path, capsys, monkeypatch):
    """A CUDA error in the copy of the loaded tensors into the model (seen on an H200: "invalid
    argument") says nothing of the files: the resume stops naming the device's error, and `--resume
    auto` does not pass over the intact checkpoint for an older one."""
    from gdn_parallel.checkpoint.reading import TensorsOnlyLoadPlanner

    def failing_copy(self, read_item):
        raise torch.AcceleratorError("CUDA error: invalid argument")
    monkeypatch.setattr(TensorsOnlyLoadPlanner, "resolve_tensor", failing_copy)
    out_dir = copy_run(saved, tmp_path)
    for resume in (str(out_dir / "checkpoints" / "step_4"), "auto"):
        err = refused(capsys, out_dir, resume)
        assert "to the device failed (AcceleratorError: CUDA error: invalid argument)" in err, err
        assert "an error of the device, not of the checkpoint's files" in err, err
        assert "fails verification" not in err and "does not hold tensor data" not in err, err
