"""The wheel that `pip install .` builds (and a cluster image installs): every module of gdn_parallel/
and of kernels/ (installed as gdn_kernels/) and every config is in it, and once installed outside the
repository the package finds its configs by the names the docs use (`configs/NAME.yaml`).

Offline: the wheel is built with the setuptools already installed (no build isolation, no index) from
a copy of the build inputs, so the build leaves nothing (build/, *.egg-info) in the working tree."""
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ["setup.py", "pyproject.toml", "README.md", "gdn_parallel", "kernels", "configs"]
# source folder in the repository -> package it is installed as
PACKAGE_DIRS = {"gdn_parallel": "gdn_parallel", "kernels": "gdn_kernels"}


def expected_wheel_files() -> set:
    expected = {"gdn_parallel/py.typed"}
    for source, package in PACKAGE_DIRS.items():
        expected |= {f"{package}/{path.relative_to(REPO_ROOT / source).as_posix()}"
                     for path in (REPO_ROOT / source).rglob("*.py")}
    expected |= {f"gdn_parallel/configs/{path.name}" for path in (REPO_ROOT / "configs").glob("*.yaml")}
    return expected


def clean_env() -> dict:
    """Environment for child processes: no PYTHONPATH that could put the repository on the path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel without build isolation needs setuptools")
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO_ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(dist), str(source)], check=True, env=clean_env(), timeout=120)
    (built,) = dist.glob("gdn_parallel-*.whl")
    return built


def test_wheel_holds_every_module_and_config(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = sorted(expected_wheel_files() - names)
    assert not missing, f"not in the wheel: {missing}"
    top_level = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert top_level == {"gdn_parallel", "gdn_kernels"}  # no stray `kernels` or `configs` package


def test_installed_package_finds_its_configs_outside_the_repository(wheel, tmp_path):
    # `pip install --target` and PYTHONPATH rather than a venv: a venv made from inside another venv
    # (the GPU image's, maybe CI's) does not see that venv's torch and PyYAML. PYTHONPATH comes ahead of
    # site-packages, and so ahead of an editable install of this repository.
    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                    str(target), str(wheel)], check=True, env=clean_env(), timeout=120)
    env = {**clean_env(), "PYTHONPATH": str(target)}
    config_names = sorted(path.name for path in (REPO_ROOT / "configs").glob("*.yaml"))
    check = textwrap.dedent(f"""
        import importlib.util
        from pathlib import Path
        import gdn_parallel
        from gdn_parallel.config import Config
        from gdn_parallel.train.__main__ import DEFAULT_CONFIG, resolve_config_path

        installed = Path(gdn_parallel.__file__).resolve().parent
        assert installed == Path({str((target / "gdn_parallel").resolve())!r}), installed
        for name in [DEFAULT_CONFIG] + ["configs/" + n for n in {config_names!r}]:
            path = resolve_config_path(name)
            assert path.parent == installed / "configs", (name, path)
            Config.from_yaml(path)
        assert resolve_config_path("elsewhere/tiny-cpu.yaml") == Path("elsewhere/tiny-cpu.yaml")
        if importlib.util.find_spec("triton") is not None:
            import gdn_kernels.gated_delta_rule  # the subpackage a plain `pip install .` used to leave out
        print("ok")
        """)
    elsewhere = tmp_path / "elsewhere"  # not the repository: no configs/ beside the cwd
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-c", check], cwd=elsewhere, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
    result = subprocess.run([str(target / "bin" / "gdn-train"), "--help"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--config" in result.stdout, result.stdout + result.stderr
