"""tools/one_config_autotune: the autotuners of a device run that wants fla-core's errors, not its
speed, keep the configurations of 4 warps at their shallowest pipelining."""
import importlib.util
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.runtime import autotuner  # noqa: E402

FOLDER = Path(__file__).resolve().parent.parent / "tools" / "one_config_autotune"


def load(monkeypatch):
    monkeypatch.setattr(autotuner.Autotuner, "__init__", autotuner.Autotuner.__init__)  # restored after
    spec = importlib.util.spec_from_file_location("one_config_sitecustomize", FOLDER / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keeps_the_four_warp_configs_at_their_shallowest_depth(monkeypatch):
    module = load(monkeypatch)
    configs = [triton.Config({"BK": bk}, num_warps=w, num_stages=s) for bk in (32, 64) for w in (1, 2, 4, 8)
               for s in (2, 3, 4)]
    kept = module.kept_configs(configs)
    assert [(c.kwargs["BK"], c.num_warps, c.num_stages) for c in kept] == [(32, 4, 2), (64, 4, 2)]
    no_four = [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 8) for s in (3, 1)]
    assert [(c.num_warps, c.num_stages) for c in module.kept_configs(no_four)] == [(2, 1), (8, 1)]


def test_an_autotuner_made_after_it_holds_only_the_kept_configs(monkeypatch):
    load(monkeypatch)

    @triton.autotune(configs=[triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4) for s in (2, 3)],
                     key=["n"])
    @triton.jit
    def kernel(x, n):
        pass

    assert [(c.num_warps, c.num_stages) for c in kernel.configs] == [(4, 2)]
