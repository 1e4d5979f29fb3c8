"""On PYTHONPATH (first), this folder makes every Triton autotuner in the process keep only the
configurations of 4 warps at their shallowest pipelining (each other meta-parameter kept). For
device runs where fla-core's kernels compute a reference error, not a speed: fla's kernels try up to
12 launch configurations each, and their compilation took the whole 10-minute device call at
K = 64 alone (2026-11-29). Never for timing fla; the suite does not use it.

    PYTHONPATH=tools/one_config_autotune:$PYTHONPATH python3 -m pytest -m gpu tests/kernels/test_kda_triton.py
"""
import triton.runtime.autotuner as _autotuner


def kept_configs(configs):
    """Those of 4 warps (all where none has 4) at the smallest num_stages among them."""
    four = [c for c in configs if c.num_warps == 4] or list(configs)
    shallowest = min(c.num_stages for c in four)
    return [c for c in four if c.num_stages == shallowest]


_tuned_init = _autotuner.Autotuner.__init__


def _init_with_kept_configs(self, fn, arg_names, configs, *args, **kwargs):
    _tuned_init(self, fn, arg_names, kept_configs(configs), *args, **kwargs)


_autotuner.Autotuner.__init__ = _init_with_kept_configs
