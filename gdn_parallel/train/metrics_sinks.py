"""Where training records go besides the console: metrics.jsonl (the ground truth), TensorBoard and
Weights & Biases.

A record is a JSON object with its optimizer `step` (0-based) and any other fields: the progress
lines' fields, {"val_loss", "val_loss_by_position": {bucket: loss}}, {"skipped_step", "reason"},
{"checkpoint": path}, {"resumed": true}, {"summary": {...}}. Every sink receives every record.
metrics.jsonl keeps the fields' flat names; TensorBoard and W&B show them grouped (`train/loss`,
`eval/loss`, `perf/tokens_per_s`: GROUPED_TAGS), nested mappings as `outer/inner`. Only the process
given an out_dir (rank 0) builds sinks.

W&B's own environment (WANDB_MODE, WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY, WANDB_DIR) wins over the
config, which supplies defaults only; W&B runs when log.wandb_project is set and the mode in force is
not `disabled`.

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


class TensorBoardSink:
    """Numbers as scalars, strings (a checkpoint path, a skip reason) as text, at the record's step."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        _require("tensorboard", "log.tensorboard=true", "tensorboard", "log.tensorboard=false")
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: a resumed run discards the events the interrupted one wrote past its checkpoint
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)

    def write(self, record: dict) -> None:
        step = record.get("step", 0)
        for tag, value in grouped(record):
            if isinstance(value, (int, float)):
                self._writer.add_scalar(tag, float(value), step)
            elif isinstance(value, str):
                self._writer.add_text(tag, value, step)

    def close(self) -> None:
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


class WandbSink:
    """A W&B run (in <out_dir>/wandb unless WANDB_DIR says otherwise); charts use the record's `step`
    as their x axis."""

    def __init__(self, log: LogConfig, out_dir: Path, run_config: dict | None = None,
                 resume: bool = False):
        _require("wandb", f"log.wandb_project={log.wandb_project!r}", "wandb", "log.wandb_project=''")
        import wandb
        id_file = out_dir / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        # console="off": the training lines are already in metrics.jsonl, and wrapping stdout would
        # fight the progress bar
        self._run = wandb.init(**wandb_init_arguments(log, out_dir), id=run_id, resume="allow",
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
                      append: bool = False, first_step: int = 0) -> list[MetricsSink]:
    """metrics.jsonl, then the backends `log` asks for, all under out_dir; `append`: a resumed run
    whose first step is first_step."""
    sinks: list[MetricsSink] = [JsonlSink(out_dir / METRICS_FILE, append=append)]
    try:
        if log is not None and log.tensorboard:
            purge_step = first_step if append else None
            sinks.append(TensorBoardSink(out_dir / TENSORBOARD_DIR, purge_step=purge_step))
        if log is not None and log.wandb_enabled:
            sinks.append(WandbSink(log, out_dir, run_config, resume=append))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
