"""The wheel that `pip install .` builds (and a cluster image installs): every module of gdn_parallel/
and of kernels/ (installed as gdn_kernels/), every config, every launch script and every console tool
is in it, and once installed outside the repository the package finds its configs by the names the
docs use (`configs/NAME.yaml`), its launch scripts (`gdn-launch-scripts`), and the tools run.

Offline: the wheel is built with the setuptools already installed (no build isolation, no index) from
a copy of the build inputs, so the build leaves nothing (build/, *.egg-info) in the working tree."""
import configparser
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ["setup.py", "pyproject.toml", "README.md", "gdn_parallel", "kernels", "configs", "launch"]
# console script -> the module:function it runs (the tools once in tools/, now in the package)
CONSOLE_TOOLS = {"gdn-train": "gdn_parallel.train.__main__:main",
                 "gdn-convert": "gdn_parallel.convert.__main__:main",
                 "gdn-verify": "gdn_parallel.verify.__main__:main",
                 "gdn-plot": "gdn_parallel.train.plot:main",
                 "gdn-eval-niah": "gdn_parallel.evaluate.niah:main",
                 "gdn-prepare-data": "gdn_parallel.data.prepare:main",
                 "gdn-launch-scripts": "gdn_parallel.runtime.launch_scripts:main"}
# source folder in the repository -> package it is installed as
PACKAGE_DIRS = {"gdn_parallel": "gdn_parallel", "kernels": "gdn_kernels"}


def expected_wheel_files() -> set:
    expected = {"gdn_parallel/py.typed"}
    for source, package in PACKAGE_DIRS.items():
        expected |= {f"{package}/{path.relative_to(REPO_ROOT / source).as_posix()}"
                     for path in (REPO_ROOT / source).rglob("*.py")}
    expected |= {f"gdn_parallel/configs/{path.name}" for path in (REPO_ROOT / "configs").glob("*.yaml")}
    expected |= {f"gdn_parallel/launch/{path.name}" for path in (REPO_ROOT / "launch").iterdir()
                 if path.is_file()}
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
    assert top_level == {"gdn_parallel", "gdn_kernels"}  # no stray `kernels`, `configs` or `launch` package


def test_wheel_declares_every_console_tool(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(name).decode())
    assert dict(entry_points["console_scripts"]) == CONSOLE_TOOLS


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
    for tool in CONSOLE_TOOLS:
        result = subprocess.run([str(target / "bin" / tool), "--help"], cwd=elsewhere, env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: {tool} "), \
            result.stdout + result.stderr
    result = subprocess.run([str(target / "bin" / "gdn-launch-scripts")], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=60)
    scripts = Path(result.stdout.strip())
    assert result.returncode == 0 and scripts == (target / "gdn_parallel" / "launch").resolve(), result.stderr
    assert {path.name for path in scripts.iterdir()} == \
        {path.name for path in (REPO_ROOT / "launch").iterdir()}
    dry_run = subprocess.run(["bash", str(scripts / "torchrun.sh"), "--max-restarts=1", "--", "--steps", "2"],
                             cwd=elsewhere, env={**env, "DRY_RUN": "1", "NPROC_PER_NODE": "2"},
                             capture_output=True, text=True, timeout=60)
    assert dry_run.stdout.split()[-5:] == ["--max-restarts=1", "-m", "gdn_parallel.train", "--steps", "2"], \
        dry_run.stdout + dry_run.stderr
    assert all(os.access(path, os.X_OK) for path in scripts.iterdir() if path.suffix in (".sh", ".sbatch"))
