"""train.profile_steps: where the time of some training steps goes, without writing code.

    python -m gdn_parallel.train --config configs/gdn-1.3b.yaml --set train.profile_steps=10,12

Those steps run under torch.profiler. Written under <train.out_dir>/profile/ by every rank:
trace_rank<R>.json (a chrome trace: chrome://tracing or https://ui.perfetto.dev) and
buckets_rank<R>.json; rank 0 prints the table. Each kernel (each operator's own time on the CPU) goes
into one bucket by its name: matmul, GDN kernels, conv + norm, attention, loss, optimizer (AdamW and
clipping), communication, casts + copies, other elementwise. On a GPU the device is idle for the
steps' wall time minus the union of its kernels' intervals: time the host makes it wait (launch
overheads, host syncs, data). The table also splits the window step by step (`per_step`: each step's
wall and busy time, buckets and largest kernels), so one window compares a slow step with a steady one
on every rank. Each profiled step waits for the device at its end (its kernels then fall inside its own
span), and the profiler adds its own overhead, so they run a little slower than the others.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

BUCKET_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # first match wins: a name like "triton_..._norm_bwd" is conv + norm, not "other"
    ("communication", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                       "gloo", "c10d", "sendrecv", "send", "recv")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "clip_grad", "optimizer")),
    ("loss", ("cross_entropy", "crossentropy", "logsumexp", "log_softmax", "nll_loss", "_row_stats",
              "_softmax_grad")),
    ("GDN kernels", ("output_forward", "qkw_backward", "span_summary", "state_forward", "state_backward",
                     "ut_forward", "ut_backward", "fold_spans", "delta_grad", "gate_fwd", "gate_bwd",
                     "l2norm_rows", "chunk_gated", "gated_delta")),
    ("conv + norm", ("conv", "norm")),
    ("attention", ("flex", "attention", "sdpa", "flash", "fmha")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear", "mm_", "_mm")),
    ("casts + copies", ("copy", "memcpy", "memset", "cast", "aten::to", "fill", "aten::cat",
                        "contiguous", "clone", "index_select", "gather", "scatter")),
)
OTHER = "other elementwise"
BUCKETS = tuple(name for name, _ in BUCKET_RULES) + (OTHER,)


def bucket_of(name: str) -> str:
    lowered = name.lower()
    for bucket, words in BUCKET_RULES:
        if any(word in lowered for word in words):
            return bucket
    return OTHER


class StepProfiler:
    """Wraps each optimizer step: profiles those in `steps` (first, last), then writes and says."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: str, rank: int, device: torch.device,
                 say: Callable[[str], None]):
        self.steps, self.device, self.say, self.rank = steps, device, say, rank
        self.folder = Path(out_dir) / "profile" if out_dir else None
        self._profile = None
        self._start = 0.0
        self._profiled = 0  # steps run under the profiler so far
        self._first = 0  # the first step it records (later than steps[0] in a run resumed inside them)

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if self._profile is None and self.steps is not None and self.steps[0] - 1 <= step <= self.steps[1]:
            self._begin(step)
        if self._profile is not None and step == self._first:
            self._start_window()
        try:
            yield
        finally:
            if self._profile is not None and self.steps is not None:
                if step >= self._first:
                    self._profiled += 1
                    if self.device.type == "cuda":   # the step's kernels end inside its own span
                        torch.cuda.synchronize(self.device)
                if step == self.steps[1]:
                    self._end()  # before the schedule's last step(), which processes the trace
                else:
                    self._profile.step()

    def close(self) -> None:
        """A run that ended inside the window (a stop asked for): write what was profiled."""
        if self._profile is not None and self._profiled:
            self._end()
        elif self._profile is not None:  # stopped in the warm-up step: nothing to write
            self._profile.__exit__(None, None, None)
            self._profile = None

    def _begin(self, step: int) -> None:
        """The profiler starts one step before the window where it can: its own start-up (CUPTI) then
        falls in that step, which is recorded nowhere, instead of showing as idle time."""
        from torch.profiler import ProfilerActivity, profile, schedule
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        assert self.steps is not None
        self._first = max(step, self.steps[0])
        warm_up = int(step < self._first)
        # acc_events changes nothing in one cycle (repeat=1); without it torch 2.11 warns "Profiler clears
        # events at the end of each cycle" at every profiled run (seen on the GPU image, 2026-11-29;
        # torch fixed the spurious warning later: pytorch#180387)
        self._profile = profile(activities=activities, acc_events=True, schedule=schedule(
            wait=0, warmup=warm_up, active=self.steps[1] - self._first + 1, repeat=1))
        self._profile.__enter__()

    def _start_window(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._start = time.perf_counter()

    def _end(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_ms = (time.perf_counter() - self._start) * 1e3
        profile, self._profile = self._profile, None
        assert profile is not None
        profile.__exit__(None, None, None)  # stops the recording wherever the schedule stands
        count = max(1, self._profiled)
        table = bucket_table(profile, wall_ms, count, self.device.type == "cuda")
        table["steps"] = [self._first, self._first + count - 1]
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            profile.export_chrome_trace(str(self.folder / f"trace_rank{self.rank}.json"))
            (self.folder / f"buckets_rank{self.rank}.json").write_text(json.dumps(table, indent=1))
        for line in format_table(table, self.folder):
            self.say(line)


def bucket_table(profile, wall_ms: float, steps: int, on_gpu: bool) -> dict:
    """Milliseconds per step by bucket, the wall and busy time per step and the GPU-idle share."""
    from torch.autograd import DeviceType
    totals = dict.fromkeys(BUCKETS, 0.0)
    kernels: dict[str, float] = {}
    if on_gpu:
        # kernels only: user annotations mirrored onto the GPU's timeline (ProfilerStep#N spans the
        # whole step, Optimizer.step#AdamW.step its optimizer) would count as busy time
        events = [e for e in profile.events() if e.device_type == DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False) and not e.name.startswith("ProfilerStep")]
        for event in events:
            duration = event.time_range.elapsed_us() / 1e3
            totals[bucket_of(event.name)] += duration
            kernels[event.name] = kernels.get(event.name, 0.0) + duration
        busy = _union_ms([(e.time_range.start, e.time_range.end) for e in events])
    else:  # the CPU's operators by their own time (children counted in their own rows)
        for row in profile.key_averages():
            own = row.self_cpu_time_total / 1e3
            if own > 0 and not row.key.startswith("ProfilerStep"):
                totals[bucket_of(row.key)] += own
                kernels[row.key] = kernels.get(row.key, 0.0) + own
        busy = sum(totals.values())
    per_step = {bucket: ms / steps for bucket, ms in totals.items()}
    top = sorted(kernels.items(), key=lambda item: -item[1])[:30]
    return {"device": "gpu" if on_gpu else "cpu", "wall_ms": wall_ms / steps, "busy_ms": busy / steps,
            "idle_share": max(0.0, 1 - busy / wall_ms) if on_gpu and wall_ms > 0 else None,
            "buckets_ms": per_step, "top": [{"name": n[:120], "ms_per_step": t / steps} for n, t in top],
            "per_step": split_by_step(profile.events(), on_gpu)[-steps:]}


def split_by_step(events, on_gpu: bool) -> list[dict]:
    """Each profiled step on its own: the kernels (CPU: operators by their own time) that started inside
    its host-side span (ProfilerStep#N; "ProfilerStep*" in events()), until the next step's span begins."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU)
    host = [(e.time_range.start, e.time_range.end, e.name, e.self_cpu_time_total) for e in events
            if e.device_type == DeviceType.CPU and not e.name.startswith("ProfilerStep")
            and getattr(e, "self_cpu_time_total", 0) > 0]
    timed = host if not on_gpu else [
        (e.time_range.start, e.time_range.end, e.name, e.time_range.elapsed_us()) for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("ProfilerStep")]
    steps = []
    for i, (start, end) in enumerate(spans):
        until = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
        inside = [t for t in timed if start <= t[0] < until]
        buckets = _summed(inside, bucket_of)
        wall = (end - start) / 1e3
        busy = _union_ms([(a, b) for a, b, _, _ in inside]) if on_gpu else sum(buckets.values())
        row = {"wall_ms": wall, "busy_ms": busy,
               "idle_share": max(0.0, 1 - busy / wall) if on_gpu and wall > 0 else None,
               "buckets_ms": buckets, "top": _largest(_summed(inside, lambda name: name[:120]))}
        if on_gpu:   # what the host did meanwhile: a stall there shows as GPU idle time
            row["host_top"] = _largest(_summed([t for t in host if start <= t[0] < until],
                                               lambda name: name[:120]))
        steps.append(row)
    return steps


def _summed(timed, key) -> dict[str, float]:
    """Milliseconds by key(name), largest first, of (start, end, name, microseconds) records."""
    totals: dict[str, float] = {}
    for _, _, name, us in timed:
        totals[key(name)] = totals.get(key(name), 0.0) + us / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _largest(totals: dict[str, float], count: int = 10) -> list[dict]:
    return [{"name": name, "ms": ms} for name, ms in list(totals.items())[:count]]


def steady_idle_share(busy_ms: float, step_ms: float) -> float:
    """The GPU-idle share of an unprofiled step: a profiled step's busy time against the wall time of
    the steady steps around it. The profiler's own per-operator work slows the host, so where the host
    launches just ahead of the device, the profiled steps' idle share shows mostly the profiler."""
    return max(0.0, 1 - busy_ms / step_ms)


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals in microseconds, as milliseconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e3


def format_table(table: dict, folder: Path | None) -> list[str]:
    first, last = table["steps"]
    where = f"; trace and table in {folder}" if folder is not None else " (train.out_dir '': not written)"
    idle = table["idle_share"]
    head = (f"profile | steps {first}-{last}: {table['wall_ms']:.1f} ms a step, "
            + (f"GPU busy {table['busy_ms']:.1f} ms (idle {idle:.1%})" if idle is not None
               else f"CPU operators {table['busy_ms']:.1f} ms") + where)
    busy = table["busy_ms"] or 1.0
    rows = sorted(table["buckets_ms"].items(), key=lambda item: -item[1])
    lines = [head] + [f"profile |   {name:<18} {ms:9.2f} ms {ms / busy:6.1%}" for name, ms in rows if ms > 0]
    if len(table.get("per_step", ())) > 1:
        for step, row in zip(range(first, last + 1), table["per_step"]):
            largest = ", ".join(f"{name} {ms:.0f}" for name, ms in list(row["buckets_ms"].items())[:3])
            busy_text = (f"GPU busy {row['busy_ms']:.1f} ms (idle {row['idle_share']:.1%})"
                         if row["idle_share"] is not None else f"CPU operators {row['busy_ms']:.1f} ms")
            lines.append(f"profile | step {step}: {row['wall_ms']:.1f} ms, {busy_text}: {largest} ms")
    return lines
