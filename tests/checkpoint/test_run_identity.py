"""A run's identity: <train.out_dir>/run_id.json, written at its first step and recorded in every
checkpoint (trainer_state.json `run_id`). Resuming a checkpoint of another run into an out_dir (a step
directory replaced by, or linked to, one of a run with another seed) is refused in one line naming
both ids, the checkpoint and the opt-in (checkpoint.allow_other_run=true); the opt-in resumes it and
records the other run. A fresh out_dir resumes any run's checkpoint under a new run id, and a
checkpoint written before runs had ids resumes, each saying so in its `resume |` line. A checkpoint's
files are read only from inside its directory: a data file linked out of it is refused naming it,
even with the checksums rewritten to match (issue 44)."""
import json
import shutil
from pathlib import Path

import pytest

from gdn_parallel.checkpoint import files, integrity
from gdn_parallel.checkpoint.errors import CheckpointError, CheckpointUnreadable
from gdn_parallel.checkpoint.reading import inside_checkpoint
from tests.checkpoint.test_untrusted import UNVERIFIED, copy_run, refused, reseal, train

ALLOW = ("--set", "checkpoint.allow_other_run=true")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs of the tiny config with checkpoints at steps 2 and 4: seed 0 ("ours") and seed 1."""
    root = tmp_path_factory.mktemp("runs")
    train(root / "ours", 4, "--set", "checkpoint.interval=2")
    train(root / "other", 4, "--set", "checkpoint.interval=2", "--set", "train.seed=1")
    return {"ours": root / "ours", "other": root / "other"}


def run_id(out_dir: Path) -> str:
    return json.loads((out_dir / files.RUN_ID_FILE).read_text())["run_id"]


def state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / files.TRAINER_STATE).read_text())


def resume_line(printed: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith("resume | ") and "| step " in line)


def test_every_checkpoint_records_the_run_id_its_out_dir_names(runs):
    ours, other = run_id(runs["ours"]), run_id(runs["other"])
    assert len(ours) == 12 and ours != other
    for step in (2, 4):
        assert state(runs["ours"] / "checkpoints" / f"step_{step}")["run_id"] == ours
        assert state(runs["other"] / "checkpoints" / f"step_{step}")["run_id"] == other


def test_the_same_run_resumes_under_its_own_id(runs, tmp_path, capsys):
    out_dir = copy_run(runs["ours"], tmp_path)
    summary = train(out_dir, 5, resume="auto")
    assert summary["start_step"] == 4
    assert resume_line(capsys.readouterr().out) == f"resume | {out_dir / 'checkpoints' / 'step_4'} | step 4"
    assert state(out_dir / "checkpoints" / "step_5")["run_id"] == run_id(runs["ours"]) == run_id(out_dir)


@pytest.mark.parametrize("how", ["replaced", "linked"])
def test_another_runs_checkpoint_in_the_out_dir_is_refused_naming_both_ids(runs, tmp_path, capsys, how):
    """step_4 replaced by (or a symbolic link to) step_4 of a run with another seed: `--resume <it>`,
    `--resume auto` and the finished run's own command (train.steps = 4) are refused in one line."""
    out_dir = copy_run(runs["ours"], tmp_path)
    foreign = out_dir / "checkpoints" / "step_4"
    shutil.rmtree(foreign)
    if how == "replaced":
        shutil.copytree(runs["other"] / "checkpoints" / "step_4", foreign)
    else:
        foreign.symlink_to(runs["other"] / "checkpoints" / "step_4", target_is_directory=True)
    ours, theirs = run_id(runs["ours"]), run_id(runs["other"])
    for resume, steps in ((str(foreign), 6), ("auto", 6), ("auto", 4)):
        err = refused(capsys, out_dir, resume, steps)
        assert (f"{foreign} is a checkpoint of another run: it records run id {theirs}, this "
                f"train.out_dir's run is {ours} ({out_dir / 'run_id.json'})") in err, err
        assert "--set checkpoint.allow_other_run=true" in err, err
        assert f"this run's newest checkpoint is {out_dir / 'checkpoints' / 'step_2'}" in err, err
        assert err.startswith("gdn-train: error: --resume auto: ") == (resume == "auto"), err
        assert ("is a symbolic link to" in err) == (how == "linked"), err
    assert run_id(out_dir) == ours and not (out_dir / "checkpoints" / "step_6").exists()


def test_the_opt_in_resumes_another_runs_checkpoint_and_records_it(runs, tmp_path, capsys):
    out_dir = copy_run(runs["ours"], tmp_path)
    foreign = out_dir / "checkpoints" / "step_4"
    shutil.rmtree(foreign)
    shutil.copytree(runs["other"] / "checkpoints" / "step_4", foreign)
    ours, theirs = run_id(runs["ours"]), run_id(runs["other"])
    summary = train(out_dir, 5, *ALLOW, resume="auto")
    assert summary["start_step"] == 4
    assert resume_line(capsys.readouterr().out).endswith(
        f"| a checkpoint of another run, {theirs}: resumed into run {ours} (checkpoint.allow_other_run=true)")
    written = state(out_dir / "checkpoints" / "step_5")
    assert (written["run_id"], written["resumed_from_run"]) == (ours, theirs)


def test_a_fresh_out_dir_resumes_another_runs_checkpoint_under_a_new_run_id(runs, tmp_path, capsys):
    """Continuing from a released checkpoint needs no flag; the same command again (the new run killed
    before it saved, or a rollback to where it began) resumes the checkpoint it began from."""
    source = runs["other"] / "checkpoints" / "step_4"
    out_dir = tmp_path / "fine-tune"
    assert train(out_dir, 5, resume=str(source))["start_step"] == 4
    record = json.loads((out_dir / files.RUN_ID_FILE).read_text())
    theirs = run_id(runs["other"])
    assert record["run_id"] != theirs and record["resumed_from_run"] == theirs
    assert record["resumed_from"] == str(source)
    assert resume_line(capsys.readouterr().out).endswith(
        f"| a checkpoint of run {theirs}: continued as run {record['run_id']}, new in this train.out_dir "
        f"({out_dir / 'run_id.json'})")
    written = state(out_dir / "checkpoints" / "step_5")
    assert (written["run_id"], written["resumed_from_run"]) == (record["run_id"], theirs)
    assert train(out_dir, 5, resume=str(source))["start_step"] == 4
    assert resume_line(capsys.readouterr().out).endswith(
        f"| a checkpoint of run {theirs}, which this train.out_dir's run {record['run_id']} began from: "
        f"resumed as run {record['run_id']}")
    assert run_id(out_dir) == record["run_id"]


def forget_run_ids(out_dir: Path) -> None:
    """Make out_dir what a run before run ids left: no run_id.json, no run_id in any checkpoint."""
    (out_dir / files.RUN_ID_FILE).unlink()
    for checkpoint in files.complete_checkpoints(str(out_dir)):
        written = state(checkpoint)
        del written["run_id"]
        (checkpoint / files.TRAINER_STATE).write_text(json.dumps(written))
        reseal(checkpoint)


def test_a_checkpoint_from_before_run_ids_resumes_saying_so(runs, tmp_path, capsys):
    out_dir = copy_run(runs["ours"], tmp_path)
    forget_run_ids(out_dir)
    assert train(out_dir, 5, resume="auto")["start_step"] == 4     # the out_dir gets its run id now
    new_id = run_id(out_dir)
    assert resume_line(capsys.readouterr().out).endswith(
        f"| the checkpoint records no run id (written before runs had ids, or by a converter): continued as "
        f"run {new_id}, new in this train.out_dir ({out_dir / 'run_id.json'})")
    assert state(out_dir / "checkpoints" / "step_5")["run_id"] == new_id
    assert train(out_dir, 5, resume=str(out_dir / "checkpoints" / "step_2"))["start_step"] == 2
    assert resume_line(capsys.readouterr().out).endswith(
        f"| the checkpoint records no run id (written before runs had ids, or by a converter): resumed as "
        f"run {new_id}")


@pytest.mark.parametrize("target", ["a copy of its own bytes", "another run's file"])
def test_a_data_file_linked_out_of_the_checkpoint_is_refused_naming_it(runs, tmp_path, capsys, target):
    """__0_0.distcp replaced by a symbolic link to a file outside the checkpoint, the checksums rewritten
    to match: `--resume <it>` is refused naming the file, `--resume auto` passes over it to step_2."""
    out_dir = copy_run(runs["ours"], tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_4"
    data = checkpoint / "__0_0.distcp"
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(data if target == "a copy of its own bytes" else runs["other"] / "checkpoints" / "step_4" /
                "__0_0.distcp", outside)
    data.unlink()
    data.symlink_to(outside)
    reseal(checkpoint)
    assert integrity.find_damage(checkpoint, ["__0_0.distcp"], integrity.read_manifest(checkpoint)) == []
    named = f"{checkpoint}/__0_0.distcp: a symbolic link to {outside}, outside the checkpoint directory"
    err = refused(capsys, out_dir, str(checkpoint))
    assert f"{checkpoint} fails verification: {named}" in err and "cp -L" in err, err
    err = refused(capsys, out_dir, str(checkpoint), 6, *UNVERIFIED)    # no checksums needed to see it
    assert named in err, err
    assert train(out_dir, 5, resume="auto")["start_step"] == 2
    assert f"resume | {checkpoint} fails verification ({named}" in capsys.readouterr().out


def test_the_tensor_reader_keeps_to_the_checkpoint_directory(tmp_path):
    checkpoint = tmp_path / "step_4"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"x")
    inside_checkpoint(checkpoint / "__0_0.distcp", checkpoint)     # a file of its own: read
    (tmp_path / "outside").write_bytes(b"x")
    (checkpoint / "__1_0.distcp").symlink_to(tmp_path / "outside")
    with pytest.raises(CheckpointUnreadable, match=r"__1_0.distcp resolves to .*outside, outside the checkp"):
        inside_checkpoint(checkpoint / "__1_0.distcp", checkpoint)
    assert files.links_out_of(checkpoint) == [("__1_0.distcp", (tmp_path / "outside").resolve())]


def test_a_torn_run_id_file_is_refused_naming_it(runs, tmp_path, capsys):
    out_dir = copy_run(runs["ours"], tmp_path)
    (out_dir / files.RUN_ID_FILE).write_text('{"run_')
    with pytest.raises(CheckpointError, match="run_id.json cannot be read"):
        files.read_run_record(str(out_dir))
    err = refused(capsys, out_dir, "auto")
    assert f"{out_dir / 'run_id.json'} cannot be read (JSONDecodeError" in err and "restore it" in err, err
