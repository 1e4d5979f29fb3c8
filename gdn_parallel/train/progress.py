"""Progress reporting for the training loop: one console line per interval, a progress bar on a
terminal, and the records every sink receives (metrics.jsonl, TensorBoard, W&B: metrics_sinks.py).

    step 10/200 | loss 4.1234 | lr 3.0e-03 | grad_norm 1.23 | tok/s 12,345 | mfu n/a | mem 512 MiB | eta 1m02s

Steps are 0-based optimizer updates. A line is printed at the first step (step 0, or the first after
a resume), at every multiple of log_every and at the last step. `loss` is the mean training loss of
the steps since the previous line (the first line: its own step's loss), `lr` and `grad_norm` belong
to the printed step, `tok/s` is measured over the interval (time spent in evaluation or
checkpointing under `paused()` is not counted), `mfu` = the interval's training FLOPs / its time / peak
FLOP/s when a peak is known (each step's FLOPs as the trainer counts them from its rows' documents,
model/flops.py, else flops_per_token per token), `mem` is the CUDA peak allocation or, on CPU, the
resident set of the process.

The loop hands every step's loss and grad norm over as tensors; they are read (synchronising the
device) only when a line is due.

With the second line (and in its record, `startup`) comes one start-up line: how long after the
process started its first step was done, split into the set-up before the loop (imports, data, model,
checkpoint) and the first step, and of that step the excess over a later step's time (the steps of the
second line's interval): the kernels' compilation and autotuning, which their caches spare the next
launch on this machine. The set-up's parts (PhaseClock, marked by train/run_setup.py) follow it in
brackets, those of 0.05 s or more: "start" is the process's own start (imports, the process group).

    startup | first step done 9.7 s after launch | set-up 8.4 s (start 4.1, data 0.3, model 2.6, ...) |
        compile + autotune ~1.0 s | a step 0.30 s
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from ..config import LogConfig
from .compile_watch import describe as describe_compiled
from .metrics_sinks import METRICS_FILE, JsonlSink, MetricsSink, read_metrics, sinks_from_config

LOSS_PLOT = "loss.png"
MATPLOTLIB_HINT = "pip install matplotlib, or the log extra: pip install -e '.[log]'"

# Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment; first match wins.
PEAK_TFLOPS = (
    ("H100", 989.0), ("H200", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
)


def peak_flops_per_s(train_config, device: torch.device) -> float | None:
    """Peak FLOP/s of one device: train.peak_tflops if set, else a known CUDA device, else None."""
    if train_config.peak_tflops > 0:
        return train_config.peak_tflops * 1e12
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in PEAK_TFLOPS:
            if fragment in name:
                return tflops * 1e12
    return None


class PhaseClock:
    """Seconds of each phase of a process's set-up: `mark(name)` closes the phase that ran since the last
    mark. The first phase, "start", runs from the process's start (imports, the launcher's work, the
    process group) to the clock's making; without /proc it is left out."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        age = process_age_s()
        if age is not None:
            self.phases["start"] = age
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])   # field 22: start time
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on a CUDA device; otherwise the process's resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return int(peak if sys.platform == "darwin" else peak * 1024)


def alloc_retries(device: torch.device) -> int:
    """How often this process's CUDA allocator has freed its cache to retry an allocation that found no
    free block (each costs a device sync and new mappings: a slow step); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class ProgressBar:
    """One line that redraws itself in place with a carriage return, at most every min_interval_s.
    A stream that stops accepting writes (a closed pipe) turns the bar off instead of failing."""

    WIDTH = 24  # characters of the bar itself

    def __init__(self, stream: TextIO, min_interval_s: float = 0.1):
        self.stream: TextIO | None = stream
        self.min_interval_s = min_interval_s
        self._drawn = 0            # characters on the line now
        self._last_draw = -math.inf
        self._text = ""

    @staticmethod
    def render(done: int, total: int, details: str) -> str:
        filled = int(ProgressBar.WIDTH * done / max(total, 1))
        bar = "#" * filled + "." * (ProgressBar.WIDTH - filled)
        return f"[{bar}] {done}/{total} {100 * done / max(total, 1):3.0f}% | {details}"

    def show(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        self._text = text
        if force or now - self._last_draw >= self.min_interval_s:
            self._last_draw = now
            self._draw()

    def hide(self) -> None:
        if self._drawn:
            self._write("\r" + " " * self._drawn + "\r")
            self._drawn = 0

    def redraw(self) -> None:
        if self._text:
            self._draw()

    def _draw(self) -> None:
        columns = shutil.get_terminal_size((100, 24)).columns
        text = self._text[:max(columns - 1, 10)]  # a wrapped line could not be overwritten
        self._write("\r" + text.ljust(self._drawn))
        self._drawn = len(text)

    def _write(self, text: str) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.stream = None


@dataclass(frozen=True)
class ProgressSettings:
    """What a ProgressLogger reports on and where its records go.

    total_steps, log_every: the run's length and a line every log_every steps (see the module doc).
    tokens_per_step: tokens of one optimizer step over every replica (tok/s).
    flops_per_token, peak_flops: the model's work per token (of a step given without its own FLOPs)
        and the peak FLOP/s it runs on (mfu; no FLOPs or no peak: mfu n/a).
    out_dir: metrics.jsonl (and the backends `log` asks for) go there; give it on one rank only.
    log: the `log:` config section (backends, progress_bar); None: no backends, no bar.
    run_config: the whole config as a dict, stored with the W&B run.
    first_step: the first step this process runs (a resumed run's checkpoint step); the clock starts
        when the logger is made, so make it after the checkpoint is loaded.
    append: a resumed run appends to metrics.jsonl after a {"step": first_step, "resumed": true}
        marker instead of starting it afresh.
    setup_phases: seconds of each part of the set-up (PhaseClock.phases), for the start-up line.
    """
    total_steps: int
    log_every: int
    tokens_per_step: int
    flops_per_token: float | None = None
    peak_flops: float | None = None
    out_dir: str = ""
    log: LogConfig | None = None
    run_config: dict | None = None
    first_step: int = 0
    append: bool = False
    setup_phases: dict | None = None


class ProgressLogger:
    """Prints the progress lines, draws the bar and fans every record out to the sinks.

    settings: what is reported and where (ProgressSettings).
    device: whose memory the lines report.
    print_fn: prints a line (default: print, flushed).
    sinks: more sinks besides those of settings.out_dir and settings.log.
    bar_stream: where the bar is drawn (default stdout).
    """

    def __init__(self, settings: ProgressSettings, device: torch.device, print_fn=None, *,
                 sinks: Sequence[MetricsSink] = (), bar_stream: TextIO | None = None):
        self.total_steps, self.log_every = settings.total_steps, max(1, settings.log_every)
        self.tokens_per_step, self.device = settings.tokens_per_step, device
        self.flops_per_token, self.peak_flops = settings.flops_per_token, settings.peak_flops
        self.first_step = first_step = settings.first_step
        self.print = print_fn or (lambda line: print(line, flush=True))
        # more entries of each step line's record, set by the trainer: what was compiled since the last
        # line ("compiled": train/compile_watch.py, also said once start-up is over) and whether a
        # checkpoint was being written in the background ("saving")
        self.extras: Callable[[], dict] = dict
        self.rank = 0   # this process's rank (the trainer's): other ranks print only their compilations
        self.out_dir = Path(settings.out_dir) if settings.out_dir else None
        self.losses: list[float] = []                      # every step's training loss, this process
        self.loss_points: list[tuple[int, float]] = []     # (step, loss) of the same steps
        self.val_points: list[tuple[int, float]] = []      # (step, val_loss)
        self.records: list[dict] = []                      # what each printed line reported
        self.last_step: int | None = None
        self._pending: list[torch.Tensor] = []             # losses not yet read from the device
        self._pending_steps: list[int] = []
        self._earlier: list[dict] = []                     # records before a resume, for loss.png

        self.sinks: list[MetricsSink] = []
        self._ground_truth: MetricsSink | None = None
        if self.out_dir is not None:
            metrics_path = self.out_dir / METRICS_FILE
            if settings.append and metrics_path.is_file():
                self._earlier = [r for r in read_metrics(metrics_path) if r.get("step", -1) < first_step]
            self.sinks = sinks_from_config(settings.log, self.out_dir, settings.run_config,
                                           first_step if settings.append else None, say=self.print)
            self._ground_truth = next(s for s in self.sinks if isinstance(s, JsonlSink))
        self.sinks.extend(sinks)

        mode = settings.log.progress_bar if settings.log is not None else "off"
        stream = bar_stream if bar_stream is not None else sys.stdout
        wanted = mode == "on" or (mode == "auto" and is_terminal(stream))
        self.bar: ProgressBar | None = ProgressBar(stream) if wanted else None
        self._plots_off = False                            # said once: loss.png cannot be drawn
        self._plotted: tuple | None = None                 # the points loss.png shows now
        if self.out_dir is not None and importlib.util.find_spec("matplotlib") is None:
            self._say_plots_off("matplotlib is not installed")
        if settings.append:
            self.record({"step": first_step, "resumed": True})
        # the clock starts last: opening the backends (wandb.init takes seconds) is not training time
        self._start = time.perf_counter()
        self._paused_total, self._steps_done = 0.0, 0
        self._start_interval(self._start)
        self.train_time_s = 0.0                            # wall time minus pauses, at the last line
        self._setup_s = process_age_s()                    # launch to the loop
        self.setup_phases = dict(settings.setup_phases or {})
        self.startup: dict | None = None                   # set at the second line (see the module doc)

    def due(self, step: int) -> bool:
        return (step in (0, self.first_step) or step % self.log_every == 0
                or step == self.total_steps - 1)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpointing) is not counted as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            pause = time.perf_counter() - start
            self._interval_paused += pause
            self._paused_total += pause

    def _say_compiled(self, step: int, compiled: dict) -> None:
        """A compilation is said by the rank that ran it: another rank's (its documents asked for a
        new kernel variant) held every rank up, yet only rank 0 prints the progress lines."""
        what = f"{describe_compiled(compiled)} since the last line (seconds of this interval)"
        if self.rank:
            print(f"note  | rank {self.rank}, step {step}: {what}", flush=True)
        else:
            self.say(f"note  | step {step}: {what}")

    def say(self, line: str) -> None:
        """Print a line above the bar; a trainer prints through this while the loop runs."""
        if self.bar is not None:
            self.bar.hide()
        self.print(line)
        if self.bar is not None:
            self.bar.redraw()

    def step(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor,
             flops: float | None = None) -> dict | None:
        """Record one finished step; print and return a record when a line is due. `flops`: the step's
        training FLOPs over every replica (its documents' work, model/flops.py); None: flops_per_token
        times the step's tokens."""
        self._count_flops(flops)
        self._pending.append(loss.detach().float().reshape(()))
        self._pending_steps.append(step)
        self._interval_steps += 1
        self._steps_done += 1
        self.last_step = step
        if not self.due(step):
            self._update_bar(step)
            return None
        losses = self._read_pending_losses()
        grad_norm_value = float(grad_norm)
        now = time.perf_counter()
        interval_s = max(now - self._interval_start - self._interval_paused, 1e-9)
        self.train_time_s += interval_s
        tokens_per_s = self._interval_steps * self.tokens_per_step / interval_s
        remaining = self.total_steps - 1 - step
        record = {
            "step": step,
            "loss": sum(losses) / len(losses),
            "lr": lr,
            "grad_norm": grad_norm_value,
            "tokens_per_s": tokens_per_s,
            "mfu": self._mfu(interval_s),
            "mem_mib": memory_bytes(self.device) / 2 ** 20,
            "elapsed_s": now - self._start,
            "eta_s": remaining * interval_s / self._interval_steps,
            "tokens": (step + 1) * self.tokens_per_step,
            "interval_s": interval_s,
            "interval_steps": self._interval_steps,
        }
        record.update(self.extras())
        compiled = record.get("compiled")
        self._start_interval(now)
        second_line = len(self.records) == 1
        if second_line:
            record["startup"] = self.startup = self._startup(self.records[0], record)
        self.records.append(record)
        self.say(self.format(record))
        if second_line:
            self.say(self.format_startup(record["startup"]))
        elif compiled and len(self.records) > 2:   # past start-up, a compilation is news: it slowed this line
            self._say_compiled(step, compiled)
        if record.get("alloc_retries"):
            retries = record["alloc_retries"]
            self.say(f"note  | step {step}: the CUDA allocator freed its cache {retries} time(s) "
                     f"since the last line to find memory (slow steps): memory is near full; lower "
                     f"train.microbatch_size or turn on train.activation_checkpointing")
        self._emit(record)
        self._update_bar(step, force=True)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(
                f"training loss is {record['loss']} at step {step}: lower train.lr or raise "
                f"train.warmup_steps, or check train.dtype")
        return record

    def _startup(self, first: dict, second: dict) -> dict:
        """Set-up and first-step times, and the first step's excess over a later step (module doc)."""
        first_s = first["interval_s"] / first["interval_steps"]
        later_s = second["interval_s"] / second["interval_steps"]
        setup = self._setup_s
        return {"setup_s": setup, "setup_phases": self.setup_phases, "first_step_s": first_s,
                "later_step_s": later_s,
                "warmup_s": max(0.0, first_s - later_s),
                "first_step_done_s": None if setup is None else setup + first["elapsed_s"]}

    @staticmethod
    def format_startup(s: dict) -> str:
        """The start-up line (module doc); without /proc, the first step's own time stands first."""
        head = (f"first step {s['first_step_s']:.1f} s" if s["setup_s"] is None else
                f"first step done {s['first_step_done_s']:.1f} s after launch | set-up {s['setup_s']:.1f} s")
        phases = [f"{name} {seconds:.1f}" for name, seconds in (s.get("setup_phases") or {}).items()
                  if seconds >= 0.05]
        if phases:
            head += f" ({', '.join(phases)})"
        return (f"startup | {head} | compile + autotune ~{s['warmup_s']:.1f} s | "
                f"a step {s['later_step_s']:.2f} s")

    def _update_bar(self, step: int, force: bool = False) -> None:
        if self.bar is None:
            return
        train_s = max(time.perf_counter() - self._start - self._paused_total, 1e-9)
        steps_per_s = self._steps_done / train_s
        remaining = self.total_steps - 1 - step
        loss = f"{self.records[-1]['loss']:.4f}" if self.records else "-"
        details = (f"loss {loss} | {steps_per_s:.2f} step/s | "
                   f"eta {format_duration(remaining / steps_per_s)}")
        self.bar.show(ProgressBar.render(step + 1, self.total_steps, details), force=force)

    def _read_pending_losses(self) -> list[float]:
        """The losses of the steps since the last line, read from the device (one sync per line)."""
        losses = torch.stack(self._pending).tolist()
        self.losses.extend(losses)
        self.loss_points.extend(zip(self._pending_steps, losses))
        self._pending.clear()
        self._pending_steps.clear()
        return losses

    def _start_interval(self, now: float) -> None:
        self._interval_start, self._interval_paused, self._interval_steps = now, 0.0, 0
        self._interval_flops: float | None = 0.0   # None: a step of the interval was not counted

    def _count_flops(self, flops: float | None) -> None:
        """Add a step's FLOPs to the interval's (flops_per_token's count when it brings none); one
        step not counted leaves the interval's MFU unknown."""
        if flops is None and self.flops_per_token:
            flops = self.flops_per_token * self.tokens_per_step
        counted = flops is not None and self._interval_flops is not None
        self._interval_flops = self._interval_flops + flops if counted else None

    def _mfu(self, interval_s: float) -> float | None:
        if not self._interval_flops or not self.peak_flops:
            return None
        return self._interval_flops / interval_s / self.peak_flops

    def format(self, r: dict) -> str:
        if r["mfu"] is None:
            mfu = "n/a"
        else:  # small models on big GPUs get more digits rather than a flat 0.0%
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] >= 0.01 else f"{100 * r['mfu']:.3f}%"
        return (f"step {r['step']}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.1e} | "
                f"grad_norm {r['grad_norm']:.2f} | tok/s {r['tokens_per_s']:,.0f} | mfu {mfu} | "
                f"mem {r['mem_mib']:,.0f} MiB | eta {format_duration(r['eta_s'])}")

    def eval(self, step: int, val_loss: float | None,
             val_loss_by_position: dict[str, float] | None = None, val_bpb: float | None = None,
             seconds: float | None = None) -> dict:
        """An evaluation after `step`: prints the eval line and records val_loss (None: no labelled
        tokens), val_bits_per_token, val_bpb (bits per byte of text: when the data records its bytes,
        train/evaluation.py), if given, the loss by position bucket {"start-end": loss} and the time the
        evaluation took (eval_s)."""
        took = "" if seconds is None else f" | {seconds:.1f} s"
        if val_loss is None:
            self.say(f"eval step {step}/{self.total_steps} | val_loss n/a{took}")
        else:
            self.val_points.append((step, val_loss))
            self.say(f"eval step {step}/{self.total_steps} | val_loss {val_loss:.4f} | "
                     f"val_bits_per_token {val_loss / math.log(2):.3f}"
                     + ("" if val_bpb is None else f" | val_bpb {val_bpb:.3f}") + took)
        record = {"step": step, "val_loss": val_loss,
                  "val_bits_per_token": None if val_loss is None else val_loss / math.log(2)}
        if val_bpb is not None:
            record["val_bpb"] = val_bpb
        if val_loss_by_position is not None:
            record["val_loss_by_position"] = dict(val_loss_by_position)
        if seconds is not None:
            record["eval_s"] = seconds
        self._emit(record)
        self.plot()
        return record

    def record(self, record: dict, line: str | None = None) -> None:
        """Send any other record to every sink, e.g. {"step", "skipped_step", "reason"} or
        {"step", "checkpoint": path}; `line`, if given, is printed above the bar."""
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"record={record!r} needs an integer 'step' (metrics.jsonl orders by it)")
        if line is not None:
            self.say(line)
        self._emit(record)

    def _emit(self, record: dict) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as err:
                if sink is self._ground_truth:
                    raise
                # a failing backend must not stop a long run; metrics.jsonl goes on
                self.sinks.remove(sink)
                self.say(f"note: {type(sink).__name__} failed ({type(err).__name__}: {err}); "
                         f"it gets no more records, {METRICS_FILE} has them all")

    def _say_plots_off(self, why: str) -> None:
        self._plots_off = True
        self.say(f"note: no {LOSS_PLOT} in {self.out_dir}: {why} ({MATPLOTLIB_HINT}); {METRICS_FILE} has "
                 f"every record")

    def plot(self) -> Path | None:
        """Write loss.png to out_dir when matplotlib is importable (else say once why not); return its
        path or None."""
        train_points = [(r["step"], r["loss"]) for r in self._earlier if "loss" in r] + self.loss_points
        if self.out_dir is None or not train_points or self._plots_off:
            return None
        val_points = [(r["step"], r["val_loss"]) for r in self._earlier if "val_loss" in r] + self.val_points
        path = self.out_dir / LOSS_PLOT
        shown = (tuple(train_points), tuple(val_points))
        if shown == self._plotted and path.exists():   # the end's plot after the last evaluation's: as drawn
            return path
        try:   # the figure alone, without pyplot's global state (and its import)
            from matplotlib.figure import Figure
        except Exception as err:   # installed but broken: said at the first plot
            self._say_plots_off(f"matplotlib cannot be imported ({type(err).__name__}: {err})")
            return None
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        ax.plot(*zip(*train_points), lw=0.8, label="train")
        if val_points:
            ax.plot(*zip(*val_points), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        partial = path.with_name(path.name + ".partial")
        fig.tight_layout()
        try:  # a new picture replaces the old one whole, or not at all (a full disk keeps the last one)
            fig.savefig(partial, dpi=100, format="png")
            os.replace(partial, path)
        except OSError as err:
            partial.unlink(missing_ok=True)
            self.say(f"note: {path} not updated ({err.strerror or err})")
            return None
        self._plotted = shown
        return path

    def close(self, summary: dict | None = None) -> None:
        """Write the summary record (at the last step), loss.png, and close every sink; idempotent."""
        if self.bar is not None:
            self.bar.hide()
        if summary is not None:
            last = self.last_step if self.last_step is not None else self.first_step
            self._emit({"step": last, "summary": summary})
        self.plot()
        sinks, self.sinks = self.sinks, []
        errors = []
        for sink in sinks:  # every sink gets closed even if one fails
            try:
                sink.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]
