"""The command line fails bad configs at its parse stage (exit 2, the field on stderr) and applies one
steps/warmup rule to `--steps N` and `--set train.steps=N`. No training runs here."""
import pytest

from gdn_parallel.train import trainer
from gdn_parallel.train.__main__ import build_parser, load_config, main


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a command line gets past loading its config."""
    def refuse(*args, **kwargs):
        raise AssertionError("training started: the config error was not caught at start-up")
    monkeypatch.setattr(trainer, "run_training", refuse)


@pytest.mark.parametrize("argv,field", [
    (["--set", "model.rope_theta=0"], "model.rope_theta"),
    (["--set", "train.beta1=1.5"], "train.beta1"),
    (["--set", "train.seq_len=1", "--set", "parallel.cp=2"], "train.seq_len"),
    (["--set", "model.conv_size=1000"], "model.conv_size"),
    (["--set", "train.lr=[1"], "train.lr"),
])
def test_bad_value_exits_2_naming_the_field(argv, field, capsys, no_training):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert field in capsys.readouterr().err


def test_malformed_yaml_and_out_dir_exit_2(tmp_path, capsys, no_training):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  steps: 3\n  lr: [1\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, expected in ((["--config", str(broken)], "broken.yaml"),
                           (["--set", f"train.out_dir={afile}"], "train.out_dir")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert expected in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--steps", "10"], ["--set", "train.steps=10"]])
def test_steps_from_either_flag_shorten_the_config_warmup(argv, capsys):
    config = load_config(build_parser().parse_args(argv))  # tiny-cpu.yaml warms up for 20 steps
    assert (config.train.steps, config.train.warmup_steps) == (10, 1)
    assert "note  | train.warmup_steps=20" in capsys.readouterr().out   # the run's first line


@pytest.mark.parametrize("argv", [["--steps", "10", "--set", "train.warmup_steps=20"],
                                  ["--set", "train.steps=10", "--set", "train.warmup_steps=20"]])
def test_steps_and_warmup_chosen_together_must_agree(argv, capsys, no_training):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "train.warmup_steps=20" in err and "train.steps=10" in err


def test_warmup_that_fits_is_kept_without_a_note(capsys):
    config = load_config(build_parser().parse_args(["--steps", "10", "--set", "train.warmup_steps=5"]))
    assert (config.train.steps, config.train.warmup_steps) == (10, 5)
    captured = capsys.readouterr()
    assert "note" not in captured.out + captured.err


def test_steps_flag_wins_over_set():
    config = load_config(build_parser().parse_args(["--steps", "10", "--set", "train.steps=50"]))
    assert config.train.steps == 10
