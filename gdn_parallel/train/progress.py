"""Progress reporting for the training loop: one console line per interval, metrics.jsonl, loss.png.

    step 10/200 | loss 4.1234 | lr 3.0e-03 | grad_norm 1.23 | tok/s 12,345 | mfu n/a | mem 512 MiB | eta 1m02s

Steps are 0-based optimizer updates. A line is printed at step 0, at every multiple of log_every and
at the last step. `loss` is the mean training loss of the steps since the previous line (step 0: its
own loss), `lr` and `grad_norm` belong to the printed step, `tok/s` is measured over the interval
(time spent in evaluation is not counted), `mfu` = flops_per_token * tok/s / peak FLOP/s when a
peak is known, `mem` is the CUDA peak allocation or, on CPU, the resident set of the process.

The loop hands every step's loss and grad norm over as tensors; they are read (synchronising the
device) only when a line is due.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment; first match wins.
PEAK_TFLOPS = (
    ("H100", 989.0), ("H200", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
)


def peak_flops_per_s(train_config, device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device: train.peak_tflops if set, else a known CUDA device, else None."""
    if train_config.peak_tflops > 0:
        return train_config.peak_tflops * 1e12
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in PEAK_TFLOPS:
            if fragment in name:
                return tflops * 1e12
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


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class ProgressLogger:
    def __init__(self, total_steps: int, log_every: int, tokens_per_step: int, device: torch.device,
                 flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
                 out_dir: str = "", print_fn=None):
        self.total_steps, self.log_every = total_steps, max(1, log_every)
        self.tokens_per_step, self.device = tokens_per_step, device
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.print = print_fn or (lambda line: print(line, flush=True))
        self.out_dir = Path(out_dir) if out_dir else None
        self.losses: List[float] = []                      # every step's training loss
        self.val_points: List[tuple] = []                  # (step, val_loss)
        self.records: List[dict] = []                      # what each printed line reported
        self._pending: List[torch.Tensor] = []             # losses not yet read from the device
        self._paused_s = 0.0
        self._start = self._interval_start = time.perf_counter()
        self._interval_paused = 0.0
        self._interval_steps = 0
        self.train_time_s = 0.0                            # wall time minus pauses
        self._metrics = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.out_dir / "metrics.jsonl", "w", encoding="utf-8")

    def due(self, step: int) -> bool:
        return step == 0 or step % self.log_every == 0 or step == self.total_steps - 1

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpointing) is not counted as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._interval_paused += time.perf_counter() - start

    def step(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> Optional[dict]:
        """Record one finished step; print and return a record when a line is due."""
        self._pending.append(loss.detach().float().reshape(()))
        self._interval_steps += 1
        if not self.due(step):
            return None
        losses = torch.stack(self._pending).tolist()       # one device sync per line
        self._pending.clear()
        self.losses.extend(losses)
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
            "mfu": self._mfu(tokens_per_s),
            "mem_mib": memory_bytes(self.device) / 2 ** 20,
            "elapsed_s": now - self._start,
            "eta_s": remaining * interval_s / self._interval_steps,
            "tokens": (step + 1) * self.tokens_per_step,
            "interval_s": interval_s,
            "interval_steps": self._interval_steps,
        }
        self._interval_start, self._interval_paused, self._interval_steps = now, 0.0, 0
        self.records.append(record)
        self.print(self.format(record))
        self._write(record)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(
                f"training loss is {record['loss']} at step {step}: lower train.lr or raise "
                f"train.warmup_steps, or check train.dtype")
        return record

    def _mfu(self, tokens_per_s: float) -> Optional[float]:
        if not self.flops_per_token or not self.peak_flops:
            return None
        return self.flops_per_token * tokens_per_s / self.peak_flops

    def format(self, r: dict) -> str:
        if r["mfu"] is None:
            mfu = "n/a"
        else:  # small models on big GPUs get more digits rather than a flat 0.0%
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] >= 0.01 else f"{100 * r['mfu']:.3f}%"
        return (f"step {r['step']}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.1e} | "
                f"grad_norm {r['grad_norm']:.2f} | tok/s {r['tokens_per_s']:,.0f} | mfu {mfu} | "
                f"mem {r['mem_mib']:,.0f} MiB | eta {format_duration(r['eta_s'])}")

    def eval(self, step: int, val_loss: float) -> None:
        self.val_points.append((step, val_loss))
        self.print(f"eval step {step}/{self.total_steps} | val_loss {val_loss:.4f} | "
                   f"val_bpb {val_loss / math.log(2):.3f}")
        self._write({"step": step, "val_loss": val_loss})
        self.plot()

    def _write(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def plot(self) -> Optional[Path]:
        """Write loss.png to out_dir when matplotlib is importable; return its path or None."""
        if self.out_dir is None or not self.losses:
            return None
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception:
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(len(self.losses)), self.losses, lw=0.8, label="train")
        if self.val_points:
            ax.plot(*zip(*self.val_points), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.out_dir / "loss.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self, summary: Optional[dict] = None) -> None:
        if summary is not None:
            self._write({"summary": summary})
        self.plot()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
