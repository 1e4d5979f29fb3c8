"""Host time of a training step's pieces: where the CPU's time goes while the GPU waits for it.

    python tools/bench_host.py --configs configs/h1-1.3b.yaml configs/gdn-1.3b.yaml --out $OUT/host.json
    python tools/bench_host.py --spy run.spy --out $OUT/spy.json   # a py-spy raw record, by function
    python tools/bench_host.py --smoke                                # CPU: the tiny config, that it runs

With half a step's work a GPU (tp 2, dp 2) a step takes the host's time (docs/benchmarks.md, "Host
time"). At one row of up to 4096 tokens the GPU's work per call is below the host's, so the host's
time of a call is its wall time before any sync. Reported, each the median of --repeats rounds (the
host of a shared machine varies by tens of percent between runs):
- launch baselines: a torch op, torch.empty, an empty Triton kernel with 1 and with 16 arguments;
- per config and row length: one micro-batch's forward and backward host milliseconds (autocast
  bf16 on CUDA, as the trainer runs), each module class's forward host microseconds per call
  (forward hooks: a class's time includes its children's), and the aten operators, launch calls and
  GPU kernels of a training step of two micro-batches as the trainer runs it on one GPU (gradients
  unset first; the weight casts shared and the second's weight gradients added in place, as
  ParallelModel.train_step does), in all and by where they come from: the innermost module whose
  forward holds them, or the autograd node whose backward does (counted: an A/B of host-side changes
  that the host's noise cannot blur);
- with --spy: the share of samples inside each function of ours and Triton's, from
  `py-spy record --nonblocking --threads -f raw -o run.spy --pid <trainer>` (the blocking default
  pauses the process at every sample, which a timeline then shows as gaps).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gdn_parallel.config import Config  # noqa: E402
from gdn_parallel.model import HybridLM  # noqa: E402
from gdn_parallel.ops.projections import gradients_accumulated_in_place, weights_cast_once  # noqa: E402
from tools.bench_common import sync  # noqa: E402


def per_call_us(fn, calls: int, device: torch.device) -> float:
    """Host microseconds per call of fn, queued without a sync (wall = host while the GPU keeps up)."""
    for _ in range(min(50, calls)):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    sync(device)
    return host


def launch_baselines(device: torch.device, calls: int) -> dict:
    x = torch.zeros(1024, device=device)
    rows = {"torch add": per_call_us(lambda: x.add(x), calls, device),
            "torch empty": per_call_us(lambda: torch.empty(1024, device=device), calls, device)}
    if device.type == "cuda":
        one, sixteen = _empty_kernels()
        small = [torch.zeros(64, device=device) for _ in range(10)]
        rows["triton, 1 argument"] = per_call_us(lambda: one[(1,)](x), calls, device)
        rows["triton, 16 arguments"] = per_call_us(
            lambda: sixteen[(1,)](*small, 4096, 8, 64, 128, 1.0, 0.5, X=4, Y=8), calls, device)
    return rows


def _empty_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def one(x):
        pass

    @triton.jit
    def sixteen(a, b, c, d, e, f, g, h, i, j, n1, n2, n3, n4, s1, s2, X: tl.constexpr, Y: tl.constexpr):
        pass

    return one, sixteen


class ModuleClock:
    """Forward host time per module class, by forward hooks (nested classes include their children)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._started: dict[int, float] = {}
        for module in model.modules():
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave)

    def _enter(self, module, _args) -> None:
        self._started[id(module)] = time.perf_counter()

    def _leave(self, module, _args, _out) -> None:
        name = type(module).__name__
        self.seconds[name] += time.perf_counter() - self._started.pop(id(module))
        self.calls[name] += 1

    def per_call_us(self) -> dict:
        return {name: self.seconds[name] / self.calls[name] * 1e6 for name in self.seconds}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def micro_batch_host(model, clock: ModuleClock, tokens: int, iters: int, device) -> dict:
    """One row of `tokens` tokens (one document): forward and backward host ms, module µs per call, and
    the operators and kernels of one more forward and backward (counts: the same on any host)."""
    ids = torch.randint(0, 200, (1, tokens + 1), device=device)

    def forward():   # new boundaries each micro-batch, on the host, as the trainer gives them
        bounds = torch.tensor([0, tokens], dtype=torch.int64)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=bounds).loss_sum

    for _ in range(2):   # compilation and autotuning
        forward().backward()
    sync(device)
    clock.reset()
    forward_s = backward_s = 0.0
    for _ in range(iters):
        start = time.perf_counter()
        loss = forward()
        middle = time.perf_counter()
        loss.backward()
        forward_s, backward_s = forward_s + middle - start, backward_s + time.perf_counter() - middle
    sync(device)
    def training_step():   # two micro-batches, as ParallelModel.train_step runs them on one GPU
        model.zero_grad(set_to_none=True)
        with weights_cast_once(), gradients_accumulated_in_place():
            for _ in range(2):
                forward().backward()

    with module_ranges(model):
        counts = work_counts(training_step, device)
    row = {"forward_host_ms": forward_s / iters * 1e3, "backward_host_ms": backward_s / iters * 1e3,
           "module_forward_us": clock.per_call_us()}
    row.update({f"step_{key}": value for key, value in counts.items()})
    model.zero_grad(set_to_none=True)
    return row


MODULE_RANGE = "module: "   # the profiler ranges of module_ranges
BACKWARD_NODE = "autograd::engine::evaluate_function: "   # torch.profiler's range of an autograd node
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module):
    """Inside, each module's forward runs in a profiler range named after its class (work_counts
    attributes operators to the innermost one)."""
    from torch.profiler import record_function
    handles, open_ranges = [], []

    def enter(module, _args) -> None:
        open_ranges.append(record_function(MODULE_RANGE + type(module).__name__))
        open_ranges[-1].__enter__()

    def leave(_module, _args, _out) -> None:
        open_ranges.pop().__exit__(None, None, None)

    for module in model.modules():
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def work_counts(step, device) -> dict:
    """aten operators (nested ones too: each is dispatched by the host), kernel launch calls and GPU
    kernels of one call of step, from torch.profiler: an A/B of host-side changes that no host's noise
    blurs. `by_place`: the operators and launch calls under each module range (module_ranges) or,
    in the backward, each autograd node ("backward: <node>")."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, acc_events=True) as recorded:
        step()
        sync(device)
    events = recorded.events()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in events
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    by_place: dict = collections.defaultdict(collections.Counter)
    for event in host:
        kind = "aten_ops" if event.name.startswith("aten::") else (
            "launch_calls" if event.name in LAUNCH_CALLS else None)
        if kind is not None:
            by_place[_place(event)][kind] += 1
    totals = {kind: sum(c[kind] for c in by_place.values()) for kind in ("aten_ops", "launch_calls")}
    ranked = sorted(by_place.items(), key=lambda item: -item[1]["launch_calls"] - item[1]["aten_ops"])
    return {**totals, "kernels": len(kernels), "by_place": {place: dict(c) for place, c in ranked}}


def _place(event) -> str:
    """The innermost module range or autograd node above a profiler event, or "other"."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(MODULE_RANGE):
            return parent.name[len(MODULE_RANGE):]
        if parent.name.startswith(BACKWARD_NODE):
            return "backward: " + parent.name[len(BACKWARD_NODE):]
        parent = parent.cpu_parent
    return "other"


def median_rows(rounds: list[dict]) -> dict:
    """The median of each number over rounds of the same keys (nested dicts key by key)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: median_rows([r[key] for r in rounds]) for key in first}
    return statistics.median(rounds)


def measure_configs(paths: list[str], tokens: list[int], args, device) -> dict:
    results = {}
    for path in paths:   # as given (the report's key), read from the repository when not found here
        config = Config.from_yaml(path if Path(path).exists() else ROOT / path, list(args.set))
        model = HybridLM(config.model).to(device)
        clock = ModuleClock(model)
        results[path] = {str(n): median_rows([micro_batch_host(model, clock, n, args.iters, device)
                                              for _ in range(args.repeats)]) for n in tokens}
        del model, clock
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def summarize_spy(path: Path, top: int = 40) -> dict:
    """Samples of a py-spy raw record (`stack;frames count` lines) per thread and, per function of
    ours (gdn_parallel, gdn_kernels) or Triton's, the share of all samples whose stack holds it."""
    threads: collections.Counter = collections.Counter()
    inside: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        thread, *frames = stack.split(";")
        threads[thread] += count
        functions = {re.sub(r":\d+\)$", ")", frame) for frame in frames
                     if any(word in frame for word in ("gdn_parallel", "gdn_kernels", "triton/"))}
        for function in functions:
            inside[function] += count
    total = sum(threads.values()) or 1
    shares = [{"function": name, "share": count / total} for name, count in inside.most_common(top)]
    return {"samples": total, "threads": dict(threads), "functions": shares}


def table(report: dict) -> str:
    lines = []
    if report.get("launch_us"):
        lines += ["| launch baseline | host µs per call |", "|---|---|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in report["launch_us"].items()]
    for path, by_tokens in report.get("configs", {}).items():
        for tokens, row in by_tokens.items():
            lines += ["", f"{path}, one row of {tokens} tokens: forward {row['forward_host_ms']:.1f} ms, "
                          f"backward {row['backward_host_ms']:.1f} ms of host time; a step of two "
                          f"micro-batches: {row['step_aten_ops']:.0f} aten operators, "
                          f"{row['step_launch_calls']:.0f} launch calls, "
                          f"{row['step_kernels']:.0f} GPU kernels",
                      "", "| module | forward host µs per call |", "|---|---|"]
            by_time = sorted(row["module_forward_us"].items(), key=lambda item: -item[1])
            lines += [f"| {name} | {us:.0f} |" for name, us in by_time]
            lines += ["", "| where (a step) | aten operators | launch calls |", "|---|---|---|"]
            lines += [f"| {place} | {c.get('aten_ops', 0):.0f} | {c.get('launch_calls', 0):.0f} |"
                      for place, c in list(row["step_by_place"].items())[:15]]
    if "spy" in report:
        lines += ["", "| function (py-spy) | share of samples |", "|---|---|"]
        lines += [f"| {row['function']} | {row['share']:.1%} |" for row in report["spy"]["functions"]]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=["configs/h1-1.3b.yaml"])
    p.add_argument("--tokens", default="256,4096", help="comma-separated row lengths")
    p.add_argument("--iters", type=int, default=10, help="micro-batches timed per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the medians are reported")
    p.add_argument("--calls", type=int, default=2000, help="calls per launch baseline")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="config override")
    p.add_argument("--spy", type=Path, default=None, help="a py-spy raw record to summarize (no measuring)")
    p.add_argument("--smoke", action="store_true", help="configs/tiny-cpu.yaml, 64 tokens, one short round")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.spy is not None:
        report: dict = {"spy": summarize_spy(args.spy)}
    else:
        if args.smoke:
            args.configs, args.tokens = ["configs/tiny-cpu.yaml"], "64"
            args.iters, args.repeats, args.calls = 1, 1, 5
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "launch_us": launch_baselines(device, args.calls),
                  "configs": measure_configs(args.configs, [int(t) for t in args.tokens.split(",")], args,
                                             device)}
    print(table(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
