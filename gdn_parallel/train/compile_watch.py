"""What was compiled while the loop ran: a step that compiles runs seconds longer than the others.

Triton compiles a kernel again for each new specialization of its arguments (an integer that becomes
1 or stops being a multiple of 16, a constexpr flag that follows the data), and torch.compile (the
sliding-window FlexAttention) compiles a graph again for a new input shape. Either makes one step
2-4x slower than its neighbours, at whatever step the data first asks for the new variant. The
watch counts both between two progress lines, so that metrics.jsonl names the cause of a slow step
and the trainer says it (train/progress.py) instead of leaving a puzzle.
"""
from __future__ import annotations

import collections


class CompileWatch:
    """Counts Triton kernel compilations (by kernel name) and torch.compile graphs since the last
    `take()`. Triton's hook is chained, never replaced; `close()` puts the previous one back."""

    def __init__(self):
        self._kernels: collections.Counter = collections.Counter()
        self._knobs = _triton_runtime_knobs()
        self._previous_hook = None
        if self._knobs is not None:
            self._previous_hook = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._on_triton_compile
        self._graphs_seen = _graphs_compiled()

    def _on_triton_compile(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self._kernels[getattr(fn, "name", None) or "triton kernel"] += 1
        if self._previous_hook is not None:
            return self._previous_hook(*args, **kwargs)
        return None

    def take(self) -> dict:
        """{"triton": {kernel: compilations}, "graphs": n} since the last take; {} when nothing compiled."""
        graphs = _graphs_compiled()
        events: dict = {}
        if self._kernels:
            events["triton"] = dict(self._kernels)
            self._kernels.clear()
        if graphs > self._graphs_seen:
            events["graphs"] = graphs - self._graphs_seen
        self._graphs_seen = graphs
        return events

    def close(self) -> None:
        if self._knobs is not None and self._knobs.jit_post_compile_hook == self._on_triton_compile:
            self._knobs.jit_post_compile_hook = self._previous_hook


def describe(events: dict) -> str:
    """'2 Triton kernels (ut_forward 1, state_forward 1) and 1 torch.compile graph'."""
    parts = []
    kernels = events.get("triton") or {}
    if kernels:
        named = ", ".join(f"{name} {count}" for name, count in sorted(kernels.items()))
        parts.append(f"{sum(kernels.values())} Triton kernel compilations ({named})")
    if events.get("graphs"):
        parts.append(f"{events['graphs']} torch.compile graph{'s' if events['graphs'] > 1 else ''}")
    return " and ".join(parts)


def _triton_runtime_knobs():
    """triton.knobs.runtime (Triton >= 3.4: the compile hook), or None without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


def _graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])
