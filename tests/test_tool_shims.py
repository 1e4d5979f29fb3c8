"""tools/plot.py, tools/eval_niah.py and tools/prepare_data.py moved into the package (gdn-plot,
gdn-eval-niah, gdn-prepare-data);
the files left in tools/ still run as scripts and import as the package's modules."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIMS = {"plot": ("gdn_parallel.train.plot", "gdn-plot"),
         "eval_niah": ("gdn_parallel.evaluate.niah", "gdn-eval-niah"),
         "prepare_data": ("gdn_parallel.data.prepare", "gdn-prepare-data")}


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_shim_imports_as_the_packages_module(shim):
    module, _ = SHIMS[shim]
    assert importlib.import_module(f"tools.{shim}") is importlib.import_module(module)


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_shim_runs_the_tool_as_a_script(shim, tmp_path):
    _, prog = SHIMS[shim]
    result = subprocess.run([sys.executable, str(REPO / "tools" / f"{shim}.py"), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {prog} "), \
        result.stdout + result.stderr
