"""Shared helpers of the benchmarks: process group, timing agreed over ranks, table, JSON.

Timing rule: every iteration starts from a synchronised device and a cross-rank barrier (a real
step ends with a gradient reduction, a sync point), is timed with CUDA events on GPU or
perf_counter on CPU, and the reported figure is the slowest rank's median.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_distributed(timeout_s: float = 300.0):
    """Init the default group (nccl on CUDA, gloo on CPU); works under torchrun or as a plain
    one-process `python`. Returns (rank, world, device)."""
    if "RANK" not in os.environ:  # plain `python tools/...`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # A bounded timeout turns a rank stuck on a peer (e.g. the peer hit OOM mid-relay) into an error
    # instead of a hang that eats the whole device budget.
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree_failed(failed: bool, device: torch.device) -> bool:
    """A barrier that also tells every rank whether any rank failed (devices idle on return).
    Every rank must leave a measurement at the same point, or the next collective is mismatched."""
    sync(device)
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_ms(step, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def time_median_ms(step, warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds of `step()` on this rank after `warmup` untimed runs; inf when any rank
    ran out of memory (an OOM'd rank keeps joining the barriers until all agree to stop)."""
    times, failed = [], False
    for i in range(warmup + iters):
        if agree_failed(failed, device):
            return math.inf
        try:
            elapsed = timed_ms(step, device)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not is_oom(err):
                raise
            failed = True
            continue
        if i >= warmup:
            times.append(elapsed)
    return math.inf if agree_failed(failed, device) else statistics.median(times)


def measure(step, warmup: int, iters: int, device: torch.device) -> dict:
    """Time `step` on every rank; returns {"ms": slowest rank's median or None, "peak_gb", "oom"}.
    An OOM on any rank marks the measurement "oom" on all of them, so all take the same next branch.
    (An OOM inside a step that talks to its peers, a CP step, leaves them waiting: the process group
    timeout ends the run. Callers skip CP steps whose CP=1 step ran out of memory.)"""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = time_median_ms(step, warmup, iters, device)
    free_memory(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    agreed = torch.tensor([ms, peak], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    ms, peak = agreed.tolist()
    oom = math.isinf(ms)
    return {"ms": None if oom else ms, "peak_gb": round(peak, 2), "oom": oom}


def profile_step(step, device: torch.device, top: int = 15) -> dict:
    """One `step` under torch.profiler: wall time, the summed time of the device's kernels (busy),
    and the kernels taking most of it, for telling compute from waiting (wall - busy)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()  # nothing cold inside the profile
    sync(device)
    # The profiler's first recorded step pays its start-up: record the second one only. One cycle
    # (repeat=1): with cycles repeating, the profiler clears the recorded step's events when the next
    # cycle begins and key_averages() comes back empty.
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):
            start = time.perf_counter()
            step()
            sync(device)
            wall_ms = (time.perf_counter() - start) * 1e3
            prof.step()
    kernels = []
    for evt in prof.key_averages():
        if evt.device_type == DeviceType.CPU:  # an op's device time is its kernels': count them once
            continue
        if evt.key.startswith("ProfilerStep"):  # the step's own annotation on the GPU track, not a kernel
            continue
        device_us = getattr(evt, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(evt, "self_cuda_time_total", 0)
        if device_us > 0:
            kernels.append((evt.key[:90], device_us / 1e3, evt.count))
    kernels.sort(key=lambda item: -item[1])
    return {"wall_ms": round(wall_ms, 2), "busy_ms": round(sum(k[1] for k in kernels), 2),
            "top": [{"kernel": name, "ms": round(t, 3), "calls": n} for name, t, n in kernels[:top]]}


def env_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else platform.processor() or "cpu")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def fmt(value, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, spec)


def print_table(rows: list, columns: list) -> None:
    """columns: (header, key, format spec) triples."""
    cells = [[header for header, _, _ in columns]]
    cells += [[fmt(row.get(key), spec) for _, key, spec in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        print("  ".join(c.ljust(w) if spec == "s" else c.rjust(w)
                        for c, w, (_, _, spec) in zip(r, widths, columns, strict=True)))
    print(flush=True)


def write_json(path: str, payload: dict) -> None:
    """Write via a temporary file so a run cut off mid-write leaves the previous version intact."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def steady_records(steps: list[dict], profile: tuple[int, int]) -> list[dict]:
    """The step records whose tokens/s is steady: a record's rate covers the steps since the previous
    record (one step at train.log_every=1, ten at the configs' 10), so it counts only where none of
    those is a warm-up step (0, 1) or in the profiled window or the step after it."""
    first, last = profile
    steady, previous = [], -1
    for record in steps:
        covered = range(previous + 1, record["step"] + 1)
        previous = record["step"]
        if covered.start >= 2 and not any(first <= s <= last + 1 for s in covered):
            steady.append(record)
    return steady


def median_step_ms(records: list[dict]) -> float:
    """The median wall time of one step over logged records (each covers interval_steps steps)."""
    return statistics.median(1e3 * r["interval_s"] / r["interval_steps"] for r in records)
