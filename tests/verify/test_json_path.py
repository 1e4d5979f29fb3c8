"""gdn-verify checks its results file before any work (issue 44, item 4): a --json path that cannot be
written, or is a directory, is refused at once with exit status 2 and one line saying what to give,
not after every layout ran (43 s on 4 CPU processes) with a traceback."""
import pytest

from gdn_parallel.verify import __main__ as verify_cli


@pytest.fixture
def no_work(monkeypatch):
    def too_late(*args, **kwargs):
        raise AssertionError("gdn-verify started working before checking --json")
    monkeypatch.setattr(verify_cli, "process_group", too_late)
    monkeypatch.setattr(verify_cli, "verify", too_late)


def refused(capsys, argv) -> str:
    assert verify_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gdn-verify: "), err
    return err


def test_a_json_path_that_cannot_be_created_is_refused_first(capsys, no_work):
    err = refused(capsys, ["--json", "/proc/x/y.json"])
    assert "--json /proc/x/y.json cannot be written: nothing can be created in '/proc'" in err, err
    assert "give --json PATH in a directory you can write" in err, err


def test_a_directory_as_json_is_refused_first(tmp_path, capsys, no_work):
    err = refused(capsys, ["--json", str(tmp_path)])
    assert f"--json {tmp_path} is a directory; give a file path, e.g. --json {tmp_path / 'verify.json'}" \
        in err, err


def test_the_default_json_path_is_checked_too(tmp_path, capsys, monkeypatch, no_work):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OUT", str(blocker))   # the default is $OUT/verify.json
    err = refused(capsys, [])
    assert f"the results file {blocker / 'verify.json'} (--json's default) cannot be written" in err, err
