"""gdn-launch-scripts in a source checkout: it names launch/, and copies every script there, executable,
never over a file already in the way unless told (tests/test_packaging.py: the installed wheel's copy)."""
import os
from pathlib import Path

import pytest

from gdn_parallel.runtime.launch_scripts import main, scripts_dir

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def test_prints_the_source_checkouts_launch_directory(capsys):
    assert main([]) == 0
    assert Path(capsys.readouterr().out.strip()) == LAUNCH == scripts_dir()


def test_copies_every_script_executable_and_refuses_to_overwrite(tmp_path, capsys):
    target = tmp_path / "job"
    assert main(["--copy-to", str(target)]) == 0
    names = sorted(path.name for path in LAUNCH.iterdir() if path.is_file())
    assert sorted(path.name for path in target.iterdir()) == names
    for name in names:
        assert (target / name).read_bytes() == (LAUNCH / name).read_bytes()
        assert os.access(target / name, os.X_OK) == name.endswith((".sh", ".sbatch")), name
    (target / "torchrun.sh").write_text("# edited\n")
    capsys.readouterr()
    assert main(["--copy-to", str(target)]) == 2
    assert "torchrun.sh" in capsys.readouterr().err and (target / "torchrun.sh").read_text() == "# edited\n"
    assert main(["--copy-to", str(target), "--force"]) == 0
    assert (target / "torchrun.sh").read_bytes() == (LAUNCH / "torchrun.sh").read_bytes()


def test_force_without_a_directory_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--force"])
    assert exited.value.code == 2 and "--force goes with --copy-to" in capsys.readouterr().err
