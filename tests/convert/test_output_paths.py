"""Every converter checks its output path before it reads anything (issue 44, item 4): an output that
exists, or that cannot be created (under /proc, under a file), is refused at once in one line naming
the argument (exit status 2), not after the checkpoint was read nor with a chained traceback."""
import pytest

from gdn_parallel.convert import commands, reshard
from gdn_parallel.convert.__main__ import main

UNCREATABLE = "/proc/x/y"   # /proc takes no new entries, not even from root


@pytest.fixture
def nothing_read(monkeypatch):
    """Fail the test if a converter starts reading its source."""
    def too_late(*args, **kwargs):
        raise AssertionError("the source was read before the output path was checked")
    for name in ("read_model", "read_hf_config", "read_torch_file"):
        monkeypatch.setattr(commands, name, too_late)
    monkeypatch.setattr(reshard, "resolve_checkpoint", too_late)


def refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command, argument", [
    ("to-hf", "OUT_DIR"), ("to-torch", "FILE"), ("from-hf", "OUT_CHECKPOINT"),
    ("from-torch", "OUT_CHECKPOINT")])
def test_an_output_that_cannot_be_created_is_refused_before_reading(command, argument, tmp_path, capsys,
                                                                   nothing_read):
    err = refused(capsys, [command, str(tmp_path / "source"), UNCREATABLE])
    assert f"{argument} {UNCREATABLE} cannot be created: nothing can be created in '/proc'" in err, err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    err = refused(capsys, [command, str(tmp_path / "source"), str(a_file / "out")])
    assert f"cannot be created: {str(a_file)!r} is a file, not a directory" in err, err


@pytest.mark.parametrize("command", ["to-hf", "to-torch", "from-hf", "from-torch"])
def test_an_existing_output_is_refused_before_reading(command, tmp_path, capsys, nothing_read):
    (tmp_path / "out").mkdir()
    err = refused(capsys, [command, str(tmp_path / "source"), str(tmp_path / "out")])
    assert f"{tmp_path / 'out'} already exists (a directory); remove it or choose another path" in err, err
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]   # no probe, no partial output left


def test_reshard_checks_its_report_and_out_before_reading(tmp_path, capsys, nothing_read):
    source = str(tmp_path / "source")
    err = refused(capsys, ["reshard", source, "--layout", "tp=1", "--report", "/proc/x/report.json"])
    assert "--report /proc/x/report.json cannot be created" in err, err
    err = refused(capsys, ["reshard", source, "--layout", "tp=1", "--report", str(tmp_path)])
    assert f"--report {tmp_path} is a directory" in err, err
    report = str(tmp_path / "report.json")
    err = refused(capsys, ["reshard", source, "--layout", "tp=1", "--report", report, "--out", "/proc/x"])
    assert "--out /proc/x cannot be written" in err, err
    (tmp_path / "a_file").write_text("")
    err = refused(capsys, ["reshard", source, "--layout", "tp=1", "--report", report, "--out",
                           str(tmp_path / "a_file")])
    assert "is a file; give a directory" in err, err
