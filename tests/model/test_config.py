"""Config: YAML round trip, overrides, validation naming the field."""
from pathlib import Path

import pytest

from gdn_parallel.config import Config, ConfigError
from tools.count_params import count_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_yaml_round_trip(tmp_path):
    config = Config.from_yaml(CONFIGS / "tiny-cpu.yaml")
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml())
    assert Config.from_yaml(path) == config


def test_overrides_are_typed_and_validated():
    config = Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["train.lr=1e-4", "model.layer_pattern=GGS",
                                                        "model.n_layers=3"])
    assert config.train.lr == 1e-4 and config.model.layer_types == "GGS"
    with pytest.raises(ConfigError, match="no field 'nope'"):
        Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["train.nope=1"])
    with pytest.raises(ConfigError, match="train.steps"):
        Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["train.steps=0"])
    with pytest.raises(ConfigError, match="must be an integer"):
        Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["model.hidden_size=1.5"])


def test_unknown_yaml_field_and_missing_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError, match="model.hiden_size"):
        Config.from_yaml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name,billions", [("gdn-0.4b", 0.4), ("h1-0.4b", 0.4), ("gdn-1.3b", 1.3),
                                           ("h1-1.3b", 1.3)])
def test_paper_scale_configs_match_their_names(name, billions):
    total = count_parameters(str(CONFIGS / f"{name}.yaml"))["total"]
    assert abs(total / 1e9 - billions) / billions < 0.05, total
