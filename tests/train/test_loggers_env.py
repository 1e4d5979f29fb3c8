"""The loggers' ecosystem cases of issue 44: W&B's WANDB_RUN_ID / WANDB_RESUME are honoured (the out_dir's
wandb_run_id file the default, a conflict said in one line), TensorBoard gets the resolved config and the
hparams plugin's session (read back from the event file), and a missing matplotlib is said once."""
import importlib.machinery
import sys
import types

import pytest
import torch

from gdn_parallel.config import Config, LogConfig
from gdn_parallel.train.metrics_sinks import (
    CONFIG_TEXT_TAG,
    HPARAMS_METRICS,
    WANDB_RUN_ID_FILE,
    WANDB_VARIABLES,
    hparams_of,
    wandb_run_id,
)
from gdn_parallel.train.progress import LOSS_PLOT, ProgressLogger, ProgressSettings

CPU = torch.device("cpu")


def run_steps(logger, steps):
    for step in steps:
        logger.step(step, torch.tensor(5.0 - 0.1 * step), 1e-3, torch.tensor(1.0))


# --- W&B: the run id -----------------------------------------------------------------------------

def test_the_id_file_is_the_default_and_a_fresh_run_gets_a_new_id(tmp_path):
    (tmp_path / WANDB_RUN_ID_FILE).write_text("fromfile\n")
    assert wandb_run_id(tmp_path, resume=True, environ={}) == ("fromfile", None)
    empty = {"WANDB_RUN_ID": ""}                                      # an empty variable is unset
    assert wandb_run_id(tmp_path, resume=True, environ=empty) == ("fromfile", None)
    fresh, note = wandb_run_id(tmp_path, resume=False, environ={})
    assert fresh != "fromfile" and len(fresh) == 8 and note is None   # a new run ignores an old file


def test_wandb_run_id_from_the_environment_wins(tmp_path):
    assert wandb_run_id(tmp_path, resume=False, environ={"WANDB_RUN_ID": "envid"}) == ("envid", None)
    assert wandb_run_id(tmp_path, resume=True, environ={"WANDB_RUN_ID": "envid"}) == ("envid", None)
    (tmp_path / WANDB_RUN_ID_FILE).write_text("envid\n")
    assert wandb_run_id(tmp_path, resume=True, environ={"WANDB_RUN_ID": "envid"}) == ("envid", None)


def test_a_conflict_between_the_environment_and_the_id_file_is_one_line_naming_both(tmp_path):
    (tmp_path / WANDB_RUN_ID_FILE).write_text("fromfile\n")
    run_id, note = wandb_run_id(tmp_path, resume=True, environ={"WANDB_RUN_ID": "envid"})
    assert run_id == "envid" and "\n" not in note
    for words in ("'envid' from WANDB_RUN_ID", "not 'fromfile'", str(tmp_path / WANDB_RUN_ID_FILE),
                  "the environment wins", "unset WANDB_RUN_ID to continue run 'fromfile'"):
        assert words in note, (words, note)


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in `wandb` module that records wandb.init's arguments (no W&B package needed)."""
    calls = []

    class Run:
        summary: dict = {}

        def define_metric(self, *args, **kwargs):
            pass

        def log(self, values):
            pass

        def finish(self):
            pass

    def init(**kwargs):
        calls.append(kwargs)
        return Run()

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)    # find_spec finds it
    module.init, module.Settings = init, lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "wandb", module)
    for variable in (*WANDB_VARIABLES, "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(variable, raising=False)
    return calls


def wandb_logger(tmp_path, lines, first_step=0):
    settings = ProgressSettings(4, 1, 64, out_dir=str(tmp_path), log=LogConfig(wandb_project="p",
                                                                               progress_bar="off"),
                                run_config={"train": {"steps": 4}}, first_step=first_step,
                                append=first_step > 0)
    return ProgressLogger(settings, CPU, lines.append)


def test_the_run_id_and_resume_mode_reach_wandb_init_and_the_id_file(tmp_path, fake_wandb, monkeypatch):
    lines = []
    wandb_logger(tmp_path, lines).close()
    first_id = (tmp_path / WANDB_RUN_ID_FILE).read_text().strip()
    assert fake_wandb[-1]["id"] == first_id and fake_wandb[-1]["resume"] == "allow"
    wandb_logger(tmp_path, lines, first_step=2).close()          # a resume: the file's id, no line
    assert fake_wandb[-1]["id"] == first_id and not [line for line in lines if "W&B" in line]

    monkeypatch.setenv("WANDB_RUN_ID", "chosen1")
    monkeypatch.setenv("WANDB_RESUME", "must")
    wandb_logger(tmp_path, lines, first_step=3).close()
    assert (fake_wandb[-1]["id"], fake_wandb[-1]["resume"]) == ("chosen1", "must")
    said = [line for line in lines if "W&B run id" in line]
    assert len(said) == 1 and f"not {first_id!r}" in said[0]
    # the file follows the run the logs went to: a later resume without the variable continues it
    assert (tmp_path / WANDB_RUN_ID_FILE).read_text().strip() == "chosen1"
    monkeypatch.delenv("WANDB_RUN_ID")
    monkeypatch.delenv("WANDB_RESUME")
    wandb_logger(tmp_path, lines, first_step=3).close()
    assert (fake_wandb[-1]["id"], fake_wandb[-1]["resume"]) == ("chosen1", "allow")


def test_wandb_offline_run_takes_its_id_from_the_environment(tmp_path, monkeypatch):
    """The real package, offline: the run's folder carries WANDB_RUN_ID's id."""
    wandb = pytest.importorskip("wandb", reason="wandb is an optional extra: pip install wandb")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    for variable in (*WANDB_VARIABLES, "WANDB_RESUME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WANDB_RUN_ID", "envrun42")
    wandb.teardown()
    try:
        logger = wandb_logger(tmp_path, [])
        run_steps(logger, range(2))
        logger.close({"final_loss": 4.9})
    finally:
        wandb.teardown()
    assert [run.name.rsplit("-", 1)[-1] for run in (tmp_path / "wandb").glob("offline-run-*")] == ["envrun42"]
    assert (tmp_path / WANDB_RUN_ID_FILE).read_text().strip() == "envrun42"


# --- TensorBoard: config and hparams ----------------------------------------------------------------

def test_hparams_are_the_configs_settings_flattened():
    flat = hparams_of({"model": {"hidden_size": 64, "layer_pattern": "GA"},
                       "train": {"lr": 1e-3, "amp": True},
                       "data": {"blend": [[1, "a"]], "none": None}, "seed": 3})
    assert flat == {"model.hidden_size": 64, "model.layer_pattern": "GA", "train.lr": 1e-3,
                    "train.amp": True, "data.blend": '[[1, "a"]]', "seed": 3}


def test_tensorboard_gets_the_config_as_text_and_the_hparams_session(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    config = Config()
    settings = ProgressSettings(4, 2, 64, out_dir=str(tmp_path), run_config=config.to_dict(),
                                log=LogConfig(tensorboard=True, progress_bar="off"))
    logger = ProgressLogger(settings, CPU, lambda _: None)
    run_steps(logger, range(4))
    logger.eval(1, 2.75)
    logger.eval(3, 2.5)
    logger.close({"final_loss": 4.7})

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    text = events.Tensors(CONFIG_TEXT_TAG + "/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"hidden_size: {config.model.hidden_size}" in text and "train:" in text
    plugin = {tag: HParamsPluginData.FromString(content)
              for tag, content in events.PluginTagToContent("hparams").items()}
    experiment = plugin["_hparams_/experiment"].experiment
    assert [info.name.tag for info in experiment.metric_infos] == list(HPARAMS_METRICS) == ["train/loss",
                                                                                         "eval/loss"]
    session = plugin["_hparams_/session_start_info"].session_start_info.hparams
    assert session["model.hidden_size"].number_value == config.model.hidden_size
    assert session["train.lr"].number_value == pytest.approx(config.train.lr)
    assert session["model.layer_pattern"].string_value == config.model.layer_pattern
    assert plugin["_hparams_/session_end_info"].session_end_info.status == 1          # STATUS_SUCCESS
    # the metric columns are the last values of the run's own scalars: the final loss and val_loss
    assert events.Scalars("train/loss")[-1].value == pytest.approx(logger.records[-1]["loss"])
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(2.5)


def test_an_unfinished_run_leaves_its_hparams_session_open(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    settings = ProgressSettings(4, 2, 64, out_dir=str(tmp_path), run_config={"train": {"steps": 4}},
                                log=LogConfig(tensorboard=True, progress_bar="off"))
    logger = ProgressLogger(settings, CPU, lambda _: None)
    run_steps(logger, range(2))
    logger.close()                     # the trainer's close on an error: no summary
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.PluginTagToContent("hparams")) == {"_hparams_/experiment",
                                                         "_hparams_/session_start_info"}


# --- loss.png without matplotlib --------------------------------------------------------------------

def test_plots_off_for_lack_of_matplotlib_is_said_once_at_start_up(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    lines = []
    logger = ProgressLogger(ProgressSettings(4, 2, 64, out_dir=str(tmp_path)), CPU, lines.append)
    assert len(lines) == 1, lines                                  # before the first step
    run_steps(logger, range(4))
    logger.eval(3, 2.5)
    logger.close({"final_loss": 4.7})
    said = [line for line in lines if LOSS_PLOT in line]
    assert len(said) == 1 and "matplotlib is not installed" in said[0]
    assert "pip install matplotlib" in said[0] and ".[log]" in said[0]
    assert not (tmp_path / LOSS_PLOT).exists()
    # without an out_dir (other ranks) nothing is drawn and nothing said
    quiet = []
    ProgressLogger(ProgressSettings(4, 2, 64), CPU, quiet.append).close()
    assert quiet == []


def test_a_broken_matplotlib_is_said_at_the_first_plot(tmp_path, monkeypatch):
    broken = types.ModuleType("matplotlib")
    broken.__spec__ = importlib.machinery.ModuleSpec("matplotlib", None)
    figure = types.ModuleType("matplotlib.figure")   # found, but its Figure fails to load

    def load(name):
        raise RuntimeError("no backend")

    figure.__getattr__ = load
    monkeypatch.setitem(sys.modules, "matplotlib", broken)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", figure)
    lines = []
    logger = ProgressLogger(ProgressSettings(4, 2, 64, out_dir=str(tmp_path)), CPU, lines.append)
    assert not [line for line in lines if LOSS_PLOT in line]       # found: nothing to say yet
    run_steps(logger, range(4))
    logger.eval(3, 2.5)
    logger.close()
    said = [line for line in lines if LOSS_PLOT in line]
    assert len(said) == 1 and "RuntimeError: no backend" in said[0] and "pip install matplotlib" in said[0]
