"""What was compiled while the loop ran: a step that compiles runs seconds longer than the others.

Triton compiles a kernel again for each new specialization of its arguments (an integer that becomes
1 or stops being a multiple of 16, a constexpr flag that follows the data), and torch.compile (the
sliding-window FlexAttention) compiles a graph again for a new input shape. Either makes one step
2-4x slower than its neighbours, at whatever step the data first asks for the new variant. The
watch counts both between two progress lines, so that metrics.jsonl names the cause of a slow step
and the trainer says it (train/progress.py) instead of leaving a puzzle. A kernel compiled again is
compared with its previous variant, argument by argument (constexpr values, argument types, Triton's
specializations such as a pointer's 16-byte alignment), and the difference is recorded ("recompiled").
"""
from __future__ import annotations

import collections


class CompileWatch:
    """Counts Triton kernel compilations (by kernel name) and torch.compile graphs since the last
    `take()`. Triton's hook is chained, never replaced; `close()` puts the previous one back."""

    def __init__(self):
        self._kernels: collections.Counter = collections.Counter()
        self._variants: dict[str, dict] = {}     # kernel -> its last compiled variant, by argument name
        self._why: dict[str, str] = {}           # kernel -> how its newest variant differs from the last
        self._knobs = _triton_runtime_knobs()
        self._previous_hook = None
        if self._knobs is not None:
            self._previous_hook = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._on_triton_compile
        self._graphs_seen = _graphs_compiled()

    def _on_triton_compile(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or "triton kernel"
        self._kernels[name] += 1
        variant = _variant(kwargs.get("compile"), fn)
        if variant is not None:
            before = self._variants.get(name)
            if before is not None and before != variant:
                self._why[name] = _difference(before, variant)
            self._variants[name] = variant
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
        if self._why:
            events["recompiled"] = dict(self._why)
            self._why.clear()
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
    for name, why in sorted((events.get("recompiled") or {}).items()):
        parts.append(f"{name} again for {why}")
    if events.get("graphs"):
        parts.append(f"{events['graphs']} torch.compile graph{'s' if events['graphs'] > 1 else ''}")
    return " and ".join(parts)


def _variant(compile_info, fn) -> dict | None:
    """{argument: (kind, value)} of one compiled variant from Triton's hook arguments: constexpr values,
    argument types and specialization attributes, keyed by argument name where Triton gives indices.
    None when the hook's arguments are not in the form this reads (another Triton version)."""
    if not isinstance(compile_info, dict):
        return None
    names = list(getattr(getattr(fn, "jit_function", None), "arg_names", None) or [])

    def named(key) -> str:
        if isinstance(key, tuple) and key and isinstance(key[0], int) and key[0] < len(names):
            return ".".join([names[key[0]], *map(str, key[1:])])
        return str(key)

    variant: dict = {}
    try:
        for key, value in (compile_info.get("signature") or {}).items():
            variant[named(key)] = ("type", str(value))
        for key, value in (compile_info.get("constants") or {}).items():
            variant[named(key)] = ("value", repr(value))
        for attrs in (compile_info.get("configs") or [])[:1]:
            for key, values in (attrs or {}).items():
                variant[named(key) + " specialization"] = ("attrs", repr(values))
    except (AttributeError, TypeError):
        return None
    return variant


def _difference(before: dict, now: dict) -> str:
    """'doc_count specialization [['tt.divisibility', 16]] -> none; HAS_H0 False -> True'."""
    changes = []
    for arg in sorted(set(before) | set(now)):
        was, became = before.get(arg), now.get(arg)
        if was != became:
            changes.append(f"{arg} {was[1] if was else 'none'} -> {became[1] if became else 'none'}")
    return "; ".join(changes) or "an identical variant"


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
