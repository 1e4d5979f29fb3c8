"""metrics_sinks: every documented record field has a grouped TensorBoard / W&B tag, and W&B's own
environment (WANDB_MODE, WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY, WANDB_DIR) wins over the config."""
from pathlib import Path

import pytest

from gdn_parallel.config import ConfigError, LogConfig
from gdn_parallel.train.metrics_sinks import (
    GROUPED_TAGS,
    UNGROUPED,
    WANDB_VARIABLES,
    JsonlSink,
    grouped,
    grouped_tag,
    sinks_from_config,
    wandb_init_arguments,
)

README = Path(__file__).resolve().parents[2] / "README.md"
GROUPS = ("train/", "eval/", "perf/", "run/", "summary")


def documented_fields():
    """The field names of README's table of metrics.jsonl (`| step | ...`, `| lr, grad_norm | ...`)."""
    text = README.read_text(encoding="utf-8")
    table = text.split("| field | meaning | unit |", 1)[1].split("\n\n", 1)[0]
    names = []
    for row in table.splitlines()[2:]:
        names += [name.strip() for name in row.split("|")[1].split(",")]
    assert "loss" in names and "val_loss" in names, names
    return [name for name in names if name != "step"]


@pytest.mark.parametrize("field", documented_fields())
def test_every_documented_field_has_a_grouped_tag(field):
    tag = grouped_tag(field)
    assert not tag.startswith(UNGROUPED) and tag.startswith(GROUPS), \
        f"metrics.jsonl field {field!r} has no group: add it to GROUPED_TAGS"


def test_the_issues_tags_and_nested_fields():
    assert {key: GROUPED_TAGS[key] for key in ("loss", "lr", "grad_norm", "val_loss", "val_bpb",
                                               "tokens_per_s", "mfu", "mem_mib")} == {
        "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "val_loss": "eval/loss",
        "val_bpb": "eval/bpb", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
        "mem_mib": "perf/mem_mib"}
    record = {"step": 3, "val_loss_by_position": {"0-64": 2.0}, "val_bits_per_token": 4.1, "novel": 1}
    assert list(grouped(record)) == [("eval/loss_by_position/0-64", 2.0), ("eval/bits_per_token", 4.1),
                                     ("other/novel", 1)]   # unknown fields keep a tag: nothing dropped


def test_wandb_environment_wins_over_the_config():
    log = LogConfig(wandb_project="from-config", wandb_mode="offline")
    out = Path("runs/a")
    assert wandb_init_arguments(log, out, {}) == {"project": "from-config", "mode": "offline", "name": "a",
                                                  "dir": "runs/a"}
    every = {variable: "x" for variable in WANDB_VARIABLES}
    assert wandb_init_arguments(log, out, every) == {}      # W&B reads each of its variables itself
    assert wandb_init_arguments(log, out, {"WANDB_MODE": "online", "WANDB_DIR": ""}) == {
        "project": "from-config", "name": "a", "dir": "runs/a"}       # an empty variable is unset


def test_wandb_mode_disabled_in_the_environment_needs_no_wandb_package(monkeypatch):
    """The config asks for wandb only when a run will be made: WANDB_MODE=disabled makes none."""
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    log = LogConfig(wandb_project="p")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not log.wandb_enabled
    log.validate()
    monkeypatch.delenv("WANDB_MODE")
    assert log.wandb_enabled
    with pytest.raises(ConfigError, match="needs the wandb package"):
        log.validate()


def test_wandb_mode_disabled_in_the_environment_writes_no_wandb_files(tmp_path, monkeypatch):
    """The issue's case: WANDB_MODE=disabled with log.wandb_project set (offline by default)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sinks = sinks_from_config(LogConfig(wandb_project="p"), tmp_path)
    for sink in sinks:
        sink.close()
    assert [type(sink) for sink in sinks] == [JsonlSink]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """A W&B home of the test's own, none of W&B's variables set; W&B reads its environment once per
    process setup, so the test gets a fresh setup and leaves none behind."""
    wandb = pytest.importorskip("wandb")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    for variable in WANDB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()


def test_wandb_run_takes_its_names_and_directory_from_the_environment(tmp_path, wandb_home):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for variable, value in {"WANDB_PROJECT": "env-project", "WANDB_NAME": "env-name",
                            "WANDB_ENTITY": "env-team", "WANDB_DIR": str(elsewhere)}.items():
        wandb_home.setenv(variable, value)
    out = tmp_path / "run"
    out.mkdir()
    (wandb_sink,) = sinks_from_config(LogConfig(wandb_project="config-project"), out)[1:]
    wandb_sink.write({"step": 0, "loss": 3.0, "val_loss_by_position": {"0-64": 2.0}})
    run = wandb_sink._run
    assert (run.project, run.name, run.entity) == ("env-project", "env-name", "env-team")
    assert {"train/loss", "eval/loss_by_position/0-64"} <= set(run.summary.keys())
    wandb_sink.close()
    assert list((elsewhere / "wandb").glob("offline-run-*")) and not (out / "wandb").exists()


def test_wandb_mode_from_the_environment_turns_on_a_run_the_config_disabled(tmp_path, wandb_home):
    wandb_home.setenv("WANDB_MODE", "offline")
    sinks = sinks_from_config(LogConfig(wandb_project="p", wandb_mode="disabled"), tmp_path)
    for sink in sinks:
        sink.close()
    assert len(sinks) == 2 and list((tmp_path / "wandb").glob("offline-run-*"))

