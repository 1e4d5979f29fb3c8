"""gdn-train --print-config: the resolved config (--config, --set, --steps applied) as YAML with every
field's help from its declaration in gdn_parallel/config.py, exit 0, and the output reads back as the
same config (tests/train/test_config_help.py: the help is the metadata the errors read too)."""
import dataclasses
import subprocess
import sys

import pytest
import yaml

from gdn_parallel.config import Config
from gdn_parallel.train.__main__ import build_parser, load_config, main
from tests.train.test_config_help import printed_help

ARGS = ["--config", "configs/tiny-cpu.yaml", "--steps", "7", "--set", "model.n_layers=2",
        "--set", "train.lr=1e-3", "--set", "data.text_suffixes=.txt,.md"]


@pytest.fixture(scope="module")
def printed():
    result = subprocess.run([sys.executable, "-m", "gdn_parallel.train", *ARGS, "--print-config"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_prints_the_resolved_config_and_reads_back_as_it(printed, tmp_path):
    expected = load_config(build_parser().parse_args(ARGS))
    assert Config.from_dict(yaml.safe_load(printed)).to_dict() == expected.to_dict()
    assert expected.train.steps == 7 and expected.model.n_layers == 2    # the command line was applied
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    assert Config.from_yaml(saved).to_dict() == expected.to_dict()


def test_every_field_has_its_help(printed):
    helped = printed_help(printed)
    config = Config()
    every_field = {f"{s.name}.{f.name}" for s in dataclasses.fields(config)
                   for f in dataclasses.fields(getattr(config, s.name))}
    assert set(helped) == every_field
    # the help, then the range rule's requirement or the choices
    assert helped["model.vocab_size"] == "the number of token ids (256 for bytes); must be >= 1"
    assert helped["checkpoint.interval"] == ("optimizer steps between checkpoints (0: only the last step, "
                                             "which is always saved); must be >= 0")
    assert helped["model.gdn_impl"].endswith("; one of auto | naive | chunk | triton")
    assert helped["model.gdn_use_gate"] == "gate the GDN output (a SiLU gate from the layer input)"


def test_a_long_help_goes_above_its_field_and_section_docstrings_are_kept(printed):
    lines = printed.splitlines()
    assert "  vocab_size: 256  # the number of token ids (256 for bytes); must be >= 1" in lines
    pattern = lines.index("  layer_pattern: GS")
    assert lines[pattern - 2:pattern] == [
        "  # one symbol per layer: G (Gated DeltaNet), K (Kimi Delta Attention), S (sliding-window "
        "attention), A (full",
        "  # causal attention); a shorter pattern is tiled when its length divides model.n_layers"]
    assert max(map(len, lines[1:])) <= 110   # the header line repeats the command line
    parallel = lines.index("parallel:")
    assert lines[parallel - 1] == \
        "# The device mesh pp x dp x cp x tp (innermost last) and how each dimension is applied."
    assert not any(line.startswith("# ModelConfig(") for line in lines)   # no generated dataclass docstring


def test_a_bad_override_is_refused_not_printed(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--print-config", "--set", "model.n_layers=0"])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "model.n_layers=0" in err
