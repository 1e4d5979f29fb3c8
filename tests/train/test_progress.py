"""ProgressLogger: every record reaches every sink, resumes append, the plain lines keep their format,
the bar draws only where asked, and the TensorBoard / W&B backends write their files."""
import importlib.util
import io
import json
import re
import time

import pytest
import torch

from gdn_parallel.config import ConfigError, LogConfig, TrainConfig
from gdn_parallel.train.metrics_sinks import read_metrics, sinks_from_config
from gdn_parallel.train.progress import ProgressLogger, ProgressSettings

CPU = torch.device("cpu")
# The line format tests/train/test_train.py checks.
LINE = re.compile(r"^step \d+/\d+ \| loss \d+\.\d{4} \| lr \d\.\de[-+]\d\d \| grad_norm \d+\.\d\d \| "
                  r"tok/s [\d,]+ \| mfu (n/a|\d+\.\d+%) \| mem [\d,]+ MiB \| eta \S+$")


class FakeSink:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_steps(logger, steps):
    for step in steps:
        logger.step(step, torch.tensor(5.0 - 0.1 * step), 1e-3, torch.tensor(1.0))


def test_every_record_reaches_every_sink(tmp_path):
    fake = FakeSink()
    logger = ProgressLogger(ProgressSettings(6, 2, 64, out_dir=str(tmp_path)), CPU, lambda _: None,
                            sinks=[fake])
    run_steps(logger, range(4))
    logger.eval(3, 2.5, {"0-64": 2.7, "64-256": 2.4})
    logger.record({"step": 4, "skipped_step": True, "reason": "loss nan, grad_norm nan"})
    logger.record({"step": 4, "checkpoint": "run/checkpoints/step_5"})
    run_steps(logger, [5])
    logger.close({"final_loss": 4.5})
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert fake.records == written and fake.closed
    assert all(isinstance(r["step"], int) for r in written)
    assert [r["step"] for r in written if "loss" in r] == [0, 2, 5]
    assert written[2]["val_loss_by_position"] == {"0-64": 2.7, "64-256": 2.4}
    assert written[-1] == {"step": 5, "summary": {"final_loss": 4.5}}
    with pytest.raises(ValueError, match="integer 'step'"):
        logger.record({"checkpoint": "x"})


def test_failing_backend_is_dropped_and_metrics_jsonl_goes_on(tmp_path):
    class Broken(FakeSink):
        def write(self, record):
            raise OSError("disk full")

    printed = []
    logger = ProgressLogger(ProgressSettings(4, 1, 64, out_dir=str(tmp_path)), CPU, printed.append,
                            sinks=[Broken()])
    run_steps(logger, range(4))
    logger.close()
    assert sum("Broken failed (OSError: disk full)" in line for line in printed) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_resume_appends_and_times_only_its_own_steps(tmp_path):
    first = ProgressLogger(ProgressSettings(12, 5, 64, out_dir=str(tmp_path)), CPU, lambda _: None)
    run_steps(first, range(8))        # lines at 0, 5; steps 6..7 are lost with the process
    first.record({"step": 5, "checkpoint": "step_6"})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "lo')                                   # killed mid-line

    class SlowSink(FakeSink):  # setting up before the first step is not training time
        def write(self, record):
            if record.get("resumed"):
                time.sleep(0.3)
            super().write(record)

    printed = []
    resumed = ProgressLogger(ProgressSettings(12, 5, 64, out_dir=str(tmp_path), first_step=6, append=True),
                             CPU, printed.append, sinks=[SlowSink()])
    run_steps(resumed, range(6, 12))
    resumed.close({"final_loss": 1.0})
    steps = [line.split()[1] for line in printed if not line.startswith("startup | ")]
    assert steps == ["6/12", "10/12", "11/12"]  # the first step has a line
    first_after = resumed.records[0]
    assert first_after["interval_steps"] == 1 and first_after["interval_s"] < 0.3
    assert first_after["tokens"] == 7 * 64
    assert first_after["eta_s"] == pytest.approx(5 * first_after["interval_s"])

    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    earlier = first.records[:2] + [{"step": 5, "checkpoint": "step_6"}]
    assert raw[:3] == [json.dumps(r) for r in earlier]                # kept as they were
    live = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], "loss" in r) for r in live] == [
        (0, True), (5, True), (5, False), (6, False), (6, True), (10, True), (11, True), (11, False)]
    assert live[3] == {"step": 6, "resumed": True}
    assert (tmp_path / "loss.png").exists() or importlib.util.find_spec("matplotlib") is None


def test_plain_lines_and_no_bar_on_a_pipe():
    printed, pipe = [], io.StringIO()
    logger = ProgressLogger(ProgressSettings(200, 10, 1024, flops_per_token=6e6, peak_flops=1e12,
                                             log=LogConfig(progress_bar="auto")),
                            CPU, printed.append, bar_stream=pipe)
    run_steps(logger, range(11))
    logger.eval(10, 3.0, val_bpb=1.25)   # bits per byte: from the data's byte counts, not the loss
    logger.close()
    assert logger.bar is None and pipe.getvalue() == ""
    assert len(printed) == 4 and all(LINE.match(line) for line in printed[:2]), printed
    assert printed[1].startswith("step 10/200 | loss 4.4500 | lr 1.0e-03 | grad_norm 1.00")
    assert printed[2].startswith("startup | ")
    assert printed[3] == "eval step 10/200 | val_loss 3.0000 | val_bits_per_token 4.328 | val_bpb 1.250"


def test_bar_on_a_terminal_redraws_in_place():
    printed, terminal = [], Terminal()
    logger = ProgressLogger(ProgressSettings(20, 10, 64, log=LogConfig(progress_bar="auto")), CPU,
                            printed.append, bar_stream=terminal)
    run_steps(logger, range(20))
    drawn = terminal.getvalue()
    assert "\n" not in drawn and drawn.count("\r[") >= 3           # one line, overwritten
    assert "20/20 100% | loss " in drawn and "step/s | eta 0s" in drawn
    assert all(LINE.match(line) for line in printed if not line.startswith("startup | "))  # as before
    logger.close()
    assert terminal.getvalue().endswith("\r") and terminal.getvalue()[-2] == " "  # the bar is wiped


def test_bar_forced_on_a_pipe_and_off_on_a_terminal():
    pipe = io.StringIO()
    forced = ProgressLogger(ProgressSettings(4, 2, 64, log=LogConfig(progress_bar="on")), CPU,
                            lambda _: None, bar_stream=pipe)
    run_steps(forced, range(2))
    pipe.close()                                                   # the reader went away
    run_steps(forced, range(2, 4))
    forced.close()
    off = ProgressLogger(ProgressSettings(4, 2, 64, log=LogConfig(progress_bar="off")), CPU, lambda _: None,
                         bar_stream=Terminal())
    assert forced.bar is not None and forced.bar.stream is None and off.bar is None


def test_missing_backend_is_a_config_error(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name in ("tensorboard", "wandb") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"log.tensorboard=true needs the tensorboard package.*pip install"):
        LogConfig(tensorboard=True).validate()
    with pytest.raises(ConfigError, match=r"log.wandb_project='p' needs the wandb package"):
        LogConfig(wandb_project="p").validate()
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        sinks_from_config(LogConfig(tensorboard=True), tmp_path)
    LogConfig(wandb_project="p", wandb_mode="disabled").validate()  # disabled needs nothing
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ConfigError, match="needs train.out_dir"):
        LogConfig(tensorboard=True).validate(TrainConfig(out_dir=""))


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logger = ProgressLogger(ProgressSettings(4, 2, 64, out_dir=str(tmp_path),
                                             log=LogConfig(tensorboard=True, progress_bar="off")),
                            CPU, lambda _: None)
    run_steps(logger, range(4))
    logger.eval(3, 2.5, {"0-64": 2.7})
    logger.record({"step": 3, "checkpoint": "run/checkpoints/step_4"})
    logger.close({"final_loss": 4.7})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    expected = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mem_mib", "eval/loss",
                "eval/loss_by_position/0-64", "summary/final_loss"}
    assert expected <= set(scalars) and "loss" not in scalars     # grouped, not flat
    assert [e.step for e in accumulator.Scalars("train/loss")] == [0, 2, 3]
    assert [e.value for e in accumulator.Scalars("eval/loss")] == [2.5]
    assert "run/checkpoint/text_summary" in accumulator.Tags()["tensors"]    # strings as text


def test_wandb_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    for variable in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_ENTITY", "WANDB_DIR", "WANDB_RUN_ID",
                     "WANDB_RESUME"):
        monkeypatch.delenv(variable, raising=False)
    wandb.teardown()  # W&B reads its environment once per process setup: a fresh one, left to no one
    log = LogConfig(wandb_project="gdn-test", progress_bar="off")      # offline by default
    for first_step, steps in ((0, range(3)), (2, range(2, 4))):
        logger = ProgressLogger(ProgressSettings(4, 1, 64, out_dir=str(tmp_path), log=log,
                                                 run_config={"train": {"steps": 4}}, first_step=first_step,
                                                 append=first_step > 0),
                                CPU, lambda _: None)
        run_steps(logger, steps)
        logger.eval(steps[-1], 2.5, {"0-64": 2.7})
        logger.close({"final_loss": 4.7})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # W&B names a run's folder offline-run-<time>-<id>, adding -1 when a resume starts within the same second
    run_ids = [re.fullmatch(r"offline-run-\d{8}_\d{6}-(\w+?)(-\d+)?", run.name).group(1) for run in runs]
    assert run_ids == [run_id, run_id]                                          # the resume continues it
    assert all(list(run.glob("*.wandb")) for run in runs)


@pytest.mark.parametrize("launched_s", [3.0, None])
def test_startup_line_splits_set_up_first_step_and_compilation(monkeypatch, launched_s):
    """With the second line, one start-up line: when the first step was done after launch, the set-up
    before the loop, and the first step's excess over the later steps (compilation, autotuning). Where
    the process's start cannot be read, the first step's own time."""
    import gdn_parallel.train.progress as progress
    clock = iter([100.0, 105.0, 106.0, 107.0])   # the loop starts; step 0 done; steps 1-2; step 3
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(progress, "process_age_s", lambda: launched_s)
    printed = []
    logger = ProgressLogger(ProgressSettings(4, 2, 64), CPU, printed.append)
    run_steps(logger, range(4))
    startup = [line for line in printed if line.startswith("startup | ")]
    assert printed.index(startup[0]) == 2 and len(startup) == 1, printed   # after the second line only
    head = ("first step done 8.0 s after launch | set-up 3.0 s" if launched_s else "first step 5.0 s")
    assert startup[0] == f"startup | {head} | compile + autotune ~4.5 s | a step 0.50 s"
    assert logger.startup["warmup_s"] == pytest.approx(4.5) and logger.startup["later_step_s"] == 0.5
    assert logger.records[1]["startup"] is logger.startup and "startup" not in logger.records[0]


def test_startup_line_names_the_set_up_phases(monkeypatch):
    """PhaseClock's phases (run_setup marks them) follow the set-up in brackets, those under 0.05 s left
    out; each mark closes the phase since the previous one, and a repeated name adds up."""
    import gdn_parallel.train.progress as progress
    from gdn_parallel.train.progress import PhaseClock
    ticks = iter([10.0, 10.02, 12.0, 12.5, 13.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(progress, "process_age_s", lambda: 4.0)
    phase = PhaseClock()
    phase.mark("checks")          # 0.02 s: left out of the line
    phase.mark("model")           # 1.98 s
    phase.mark("data")            # 0.5 s
    phase.mark("model")           # 0.5 s more
    assert phase.phases == pytest.approx({"start": 4.0, "checks": 0.02, "model": 2.48, "data": 0.5})
    clock = iter([100.0, 105.0, 106.0, 107.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    printed = []
    logger = ProgressLogger(ProgressSettings(4, 2, 64, setup_phases=phase.phases), CPU, printed.append)
    run_steps(logger, range(4))
    startup = next(line for line in printed if line.startswith("startup | "))
    assert "| set-up 4.0 s (start 4.0, model 2.5, data 0.5) |" in startup, startup
    assert logger.startup["setup_phases"]["checks"] == pytest.approx(0.02)


def test_process_age_is_read_on_linux():
    import sys

    from gdn_parallel.train.progress import process_age_s
    age = process_age_s()
    if sys.platform.startswith("linux"):
        assert age is not None and age > 0   # this process has run for a while (pytest, torch)
