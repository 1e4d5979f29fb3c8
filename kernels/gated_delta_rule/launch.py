"""Launch settings that fit the device: each kernel tries its settings fastest first.

Shared memory per program grows with the key block (all of K, up to 256), the value block, the
element size (fp32 inputs double it) and the software-pipelining depth, and its limit depends on the
device (227 KB per block on the H100 and H200). Rather than predict the compiler's allocation, a
launch tries the settings in order: a setting the device cannot hold fails its resource check at
load time (triton's OutOfResources, before anything runs) and the next, smaller one is tried. The
setting that ran is remembered per kernel, shapes, dtype and device, so the search happens once per
process. tools/kernel_resources.py replays this choice for sm_90 on any machine.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import triton
from triton.runtime.errors import OutOfResources

_CHOSEN: dict[tuple, int] = {}


def setting_ladder(block_v: int, num_warps: int, num_stages: int, min_block_v: int = 16) -> list[dict]:
    """Settings from (block_v, num_stages) down to (min_block_v, 1): first shallower pipelining, then
    narrower value blocks (each halves the per-program tiles that scale with V)."""
    settings, bv = [], block_v
    stages = [s for s in (num_stages, 2, 1) if s <= num_stages]
    while True:
        for s in dict.fromkeys(stages):
            settings.append({"BV": bv, "num_warps": num_warps, "num_stages": s})
        if bv <= min_block_v:
            return settings
        bv = max(min_block_v, bv // 2)
        stages = [s for s in (2, 1) if s <= num_stages]


def launch_fitting(kernel, grid: Callable[[dict], tuple], args: Sequence, settings: list[dict], key: tuple,
                   **constexprs) -> dict:
    """kernel[grid(setting)](*args, **setting, **constexprs) with the first setting that the device
    can run (BV, num_warps, num_stages in each setting); returns that setting."""
    key = (kernel.__name__, *key)
    error = None
    for index in range(_CHOSEN.get(key, 0), len(settings)):
        setting = settings[index]
        try:
            kernel[grid(setting)](*args, **setting, **constexprs)
        except OutOfResources as err:
            error = err
            continue
        _CHOSEN[key] = index
        return setting
    raise RuntimeError(f"{kernel.__name__}: none of the launch settings {settings} fits this device's "
                       f"shared memory (kernel, K, V, dtype, device = {key}); the smallest failed with: "
                       f"{error}. tools/kernel_resources.py shows each kernel's need for a device; "
                       f"gated_delta_rule(impl='chunk') runs any shape"
                       ) from error


def chosen_settings() -> dict[tuple, int]:
    """The index of the setting each (kernel, shapes, dtype, device) runs with (for tools and tests)."""
    return dict(_CHOSEN)


def value_blocks(V: int, block_v: int) -> int:
    """The widest value block worth launching for V columns: block_v, or less when V is narrower."""
    return max(16, min(block_v, triton.next_power_of_2(V)))
