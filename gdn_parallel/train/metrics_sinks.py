"""Where training records go besides the console: metrics.jsonl (the ground truth), TensorBoard and
Weights & Biases.

A record is a JSON object with its optimizer `step` (0-based) and any other fields: the progress
lines' fields, {"val_loss", "val_loss_by_position": {bucket: loss}}, {"skipped_step", "reason"},
{"checkpoint": path}, {"resumed": true}, {"summary": {...}}. Every sink receives every record.
metrics.jsonl keeps the fields' flat names; TensorBoard and W&B show them grouped (`train/loss`,
`eval/loss`, `perf/tokens_per_s`: GROUPED_TAGS), nested mappings as `outer/inner`. Only the process
given an out_dir (rank 0) builds sinks.

W&B's own environment (WANDB_MODE, WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY, WANDB_DIR, WANDB_RUN_ID,
WANDB_RESUME) wins over the config, which supplies defaults only; W&B runs when log.wandb_project is
set and the mode in force is not `disabled`. The run id is WANDB_RUN_ID's, else (a resumed run) the one
in <out_dir>/wandb_run_id, else a new one; it is written to that file, so a later resume continues the
same run. Where WANDB_RUN_ID and the file of a resumed out_dir disagree, one printed line says that the
environment's id is used.

TensorBoard also gets the resolved config, as text (`run/config`) and as the hparams plugin's session
(every setting `section.key`, the metrics `train/loss` and `eval/loss`: the HParams tab shows each
run's settings beside its last loss and val_loss).

A resumed run appends to metrics.jsonl after a {"step": N, "resumed": true} marker: records of the
earlier process at steps >= N describe work the checkpoint does not hold, and `read_metrics` drops
them (TensorBoard drops its own through purge_step).
"""
from __future__ import annotations

import importlib.util
import json
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import yaml

from ..config import ConfigError, LogConfig

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"   # one W&B run across resumes of the same out_dir


class MetricsSink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


# The one mapping from a record's fields (README's table of metrics.jsonl) to the grouped tags of
# TensorBoard and W&B: train/ what the optimizer did, eval/ validation, perf/ speed and memory, run/
# events of the run. A field missing here is grouped by grouped_tag's fallback, never dropped.
GROUPED_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
    "skipped_step": "train/skipped_step", "reason": "train/skip_reason",
    "val_loss": "eval/loss", "val_bpb": "eval/bpb", "val_loss_by_position": "eval/loss_by_position",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "mem_mib": "perf/mem_mib",
    "elapsed_s": "perf/elapsed_s", "eta_s": "perf/eta_s", "interval_s": "perf/interval_s",
    "interval_steps": "perf/interval_steps", "startup": "perf/startup",
    "checkpoint": "run/checkpoint", "resumed": "run/resumed", "summary": "summary",
}
UNGROUPED = "other/"


def grouped_tag(field: str) -> str:
    """A record field's tag: GROUPED_TAGS, else `eval/<rest>` for a `val_<rest>` field, else other/<field>."""
    if field in GROUPED_TAGS:
        return GROUPED_TAGS[field]
    if field.startswith("val_"):
        return "eval/" + field[len("val_"):]
    return UNGROUPED + field


def grouped(record: dict) -> Iterator[tuple[str, object]]:
    """(tag, value) for every field but `step`, tags grouped (GROUPED_TAGS); nested mappings give
    `outer/inner` tags."""
    for key, value in record.items():
        if key != "step":
            yield from _nested(grouped_tag(key), value)


def _nested(tag: str, value) -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _nested(f"{tag}/{key}", inner)
    else:
        yield tag, value


def read_metrics(path) -> list[dict]:
    """The live records of a metrics.jsonl: a resume marker at step N drops the earlier records at
    steps >= N; a torn last line (a killed process) is skipped."""
    records: list[dict] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("resumed"):
                records = [r for r in records if r.get("step", -1) < record["step"]]
            records.append(record)
    return records


class JsonlSink:
    """metrics.jsonl: one JSON object per line, flushed per record so a crash loses nothing."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = append and path.exists() and path.stat().st_size > 0 and not _ends_with_newline(path)
        self._file = open(path, "a" if append else "w", encoding="utf-8")
        if torn:  # a killed writer left half a line: end it so the next record stands on its own
            self._file.write("\n")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


# the HParams tab's metric columns: the last value of these scalars in the run
HPARAMS_METRICS = (GROUPED_TAGS["loss"], GROUPED_TAGS["val_loss"])
CONFIG_TEXT_TAG = "run/config"


def hparams_of(run_config: Mapping) -> dict[str, object]:
    """The config's settings as hparams: `section.key` -> a number, bool or string (lists and mappings
    as JSON; None left out: the plugin has no null)."""
    flat: dict[str, object] = {}
    for key, value in run_config.items():
        if isinstance(value, Mapping) and all(isinstance(inner, str) for inner in value):
            flat.update({f"{key}.{inner}": setting for inner, setting in hparams_of(value).items()})
        elif isinstance(value, (bool, int, float, str)):
            flat[key] = value
        elif value is not None:
            flat[key] = json.dumps(value, sort_keys=True, default=str)
    return flat


class TensorBoardSink:
    """Numbers as scalars, strings (a checkpoint path, a skip reason) as text, at the record's step;
    the run's config as text and hparams (module doc) at its first step, and at close, when the run
    wrote its summary (it finished), the end of the hparams session."""

    def __init__(self, log_dir: Path, purge_step: int | None = None, run_config: dict | None = None):
        _require("tensorboard", "log.tensorboard=true", "tensorboard", "log.tensorboard=false")
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        # purge_step: a resumed run discards the events the interrupted one wrote past its checkpoint
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)
        self._session_end = None
        self._finished = False
        if run_config is not None:
            step = purge_step or 0
            # four spaces: a code block in the text plugin's markdown, the YAML shown as written
            text = "    " + yaml.safe_dump(run_config, sort_keys=False).rstrip("\n").replace("\n", "\n    ")
            self._writer.add_text(CONFIG_TEXT_TAG, text, step)
            # the metric values are the scalars' own, so the plugin is told their tags only
            experiment, session_start, self._session_end = hparams(
                hparams_of(run_config), dict.fromkeys(HPARAMS_METRICS, 0.0))
            for summary in (experiment, session_start):
                self._writer.file_writer.add_summary(summary, step)

    def write(self, record: dict) -> None:
        step = record.get("step", 0)
        self._finished = self._finished or "summary" in record
        for tag, value in grouped(record):
            if isinstance(value, (int, float)):
                self._writer.add_scalar(tag, float(value), step)
            elif isinstance(value, str):
                self._writer.add_text(tag, value, step)

    def close(self) -> None:
        if self._session_end is not None and self._finished:   # the HParams tab: status "success"
            self._writer.file_writer.add_summary(self._session_end)
        self._writer.close()


# W&B's own variables, each naming the wandb.init argument it sets; where one is set, W&B reads it and
# the config's value of that argument is not passed (the config supplies defaults only).
WANDB_VARIABLES = {"WANDB_MODE": "mode", "WANDB_PROJECT": "project", "WANDB_NAME": "name",
                   "WANDB_ENTITY": "entity", "WANDB_DIR": "dir"}


def wandb_init_arguments(log: LogConfig, out_dir: Path,
                         environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the config gives wandb.init: project, mode, name (out_dir's) and dir (out_dir), each only
    where its W&B variable is unset or empty (the config has no entity: W&B's own default holds)."""
    environ = os.environ if environ is None else environ
    defaults = {"project": log.wandb_project, "mode": log.wandb_mode, "name": out_dir.name,
                "dir": str(out_dir)}
    overridden = {argument for variable, argument in WANDB_VARIABLES.items() if environ.get(variable)}
    return {argument: value for argument, value in defaults.items() if argument not in overridden}


RUN_ID_VARIABLE, RESUME_VARIABLE = "WANDB_RUN_ID", "WANDB_RESUME"
DEFAULT_RESUME = "allow"   # a resumed out_dir continues its run; a new id starts one


def wandb_run_id(out_dir: Path, resume: bool,
                 environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The W&B run id (WANDB_RUN_ID, else a resumed out_dir's wandb_run_id file, else a new one) and,
    where WANDB_RUN_ID and that file disagree, the line that says which is used and why."""
    environ = os.environ if environ is None else environ
    id_file = out_dir / WANDB_RUN_ID_FILE
    from_file = id_file.read_text().strip() if resume and id_file.is_file() else ""
    from_environment = environ.get(RUN_ID_VARIABLE, "").strip()
    if not from_environment:
        return from_file or uuid.uuid4().hex[:8], None
    if from_file and from_file != from_environment:
        return from_environment, (
            f"note: W&B run id {from_environment!r} from {RUN_ID_VARIABLE}, not {from_file!r} from "
            f"{id_file}: the environment wins over the id file, as W&B's other variables do (unset "
            f"{RUN_ID_VARIABLE} to continue run {from_file!r})")
    return from_environment, None


class WandbSink:
    """A W&B run (in <out_dir>/wandb unless WANDB_DIR says otherwise; its id: wandb_run_id); charts
    use the record's `step` as their x axis. `say` prints the line of an id conflict."""

    def __init__(self, log: LogConfig, out_dir: Path, run_config: dict | None = None,
                 resume: bool = False, say=print):
        _require("wandb", f"log.wandb_project={log.wandb_project!r}", "wandb", "log.wandb_project=''")
        import wandb
        run_id, conflict = wandb_run_id(out_dir, resume)
        if conflict is not None:
            say(conflict)
        (out_dir / WANDB_RUN_ID_FILE).write_text(run_id + "\n")   # the run a later resume continues
        # console="off": the training lines are already in metrics.jsonl, and wrapping stdout would
        # fight the progress bar
        self._run = wandb.init(**wandb_init_arguments(log, out_dir), id=run_id,
                               resume=os.environ.get(RESUME_VARIABLE) or DEFAULT_RESUME,
                               config=run_config, settings=wandb.Settings(console="off", silent=True))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        values: dict[str, object] = {tag: value for tag, value in grouped(record) if value is not None}
        if "summary" in record:
            self._run.summary.update(values)
        else:
            self._run.log({"step": record.get("step", 0), **values})

    def close(self) -> None:
        self._run.finish()


def _require(module: str, asked_by: str, package: str, off: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{asked_by} needs the {package} package, which is not installed: "
                          f"pip install {package}, or set {off}")


def sinks_from_config(log: LogConfig | None, out_dir: Path, run_config: dict | None = None,
                      resumed_at: int | None = None, say=print) -> list[MetricsSink]:
    """metrics.jsonl, then the backends `log` asks for, all under out_dir; `resumed_at`: the first step
    of a resumed run (None: a new run); `say` prints a line about a backend's set-up."""
    sinks: list[MetricsSink] = [JsonlSink(out_dir / METRICS_FILE, append=resumed_at is not None)]
    try:
        if log is not None and log.tensorboard:
            sinks.append(TensorBoardSink(out_dir / TENSORBOARD_DIR, purge_step=resumed_at,
                                         run_config=run_config))
        if log is not None and log.wandb_enabled:
            sinks.append(WandbSink(log, out_dir, run_config, resume=resumed_at is not None, say=say))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
