"""Without a GPU, Triton kernels run in Triton's interpreter. The variable is read when a kernel is
decorated, so it is set here, before any test module imports gdn_kernels.

On a GPU, fp32 operands of tl.dot default to TF32 (10-bit mantissa); the fp32 kernel tests check
the algorithm against fp32 oracles at 1e-5, so they ask for fp32-accurate products there: 3xTF32
(split operands, error ~2^-22 per product, on the tensor cores). Not IEEE: Hopper has no fp32 MMA,
and IEEE dots of 64 x 128 tiles become unrolled FMA code whose compilation took 491 s for one
K = 128 test on an H100 (3xTF32: 60 s). The precision the kernels run at in training is
measured in bf16 by tools/check_kernels_gpu.py (its own process, Triton's defaults).

Every test is marked `unit` or `integration` here, at collection (pyproject.toml's markers say what
each means): a test marked by hand keeps its marker; the modules of INTEGRATION_MODULES are
integration as a whole; any other test is integration when it starts a process, i.e. when its body,
its fixtures, or the test-suite and tools/ helpers they call (followed through the names their code
reads) use one of PROCESS_STARTERS or pass one of PROCESS_ARGUMENTS; everything else is unit (a library's
own helper process, such as wandb's service, does not count). `pytest -m unit` and `pytest -m integration`
together run exactly what `pytest tests` runs (tests/test_markers.py checks it)."""
import functools
import importlib
import inspect
import os
import sys
import types
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ.setdefault("TRITON_F32_DEFAULT", "tf32x3")

REPO = Path(__file__).resolve().parents[1]
KINDS = ("unit", "integration")
# Integration by what they are, whatever they run: the user journeys, the wheel build, the linters and
# the import/ownership rules over the whole tree.
INTEGRATION_MODULES = {
    "tests/checkpoint/test_journeys.py",
    "tests/test_packaging.py",
    "tests/test_static_checks.py",
    "tests/test_layering.py",
    "tests/test_one_owner.py",
    "tests/test_tool_shims.py",
}
# Names whose use starts another process: the modules themselves (any attribute of them) and the
# suite's spawner of gloo ranks (tests/parallel/launcher.py).
PROCESS_STARTERS = {"subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process"}
PROCESS_HELPERS = {("tests.parallel.launcher", "run_workers")}
# Command-line arguments by which a test asks the package itself for processes (a walk does not go into
# the package): gdn-prepare-data's worker pool.
PROCESS_ARGUMENTS = {"--workers"}
# Code followed from a test into the functions it names: the suite's own helpers and tools/ (whose
# scripts the tests call in-process); the package is not followed (its only process starter,
# gdn_parallel/data/prepare.py's worker pool, is asked for by PROCESS_ARGUMENTS).
FOLLOWED = (f"{REPO / 'tests'}{os.sep}", f"{REPO / 'tools'}{os.sep}")


def pytest_report_header():
    from tests.seeds import OFFSET_VARIABLE, seed_offset
    return f"{OFFSET_VARIABLE}={seed_offset()} (every test seed shifted by it; tests/seeds.py)"


def _starter_module(name: str) -> bool:
    return any(name == module or name.startswith(f"{module}.") for module in PROCESS_STARTERS)


def _followed(obj) -> bool:
    code = getattr(obj, "__code__", None)
    if code is not None:
        path = code.co_filename
    elif isinstance(obj, types.ModuleType):
        path = getattr(obj, "__file__", None) or ""
    else:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(module, "__file__", None) or ""
    return path.startswith(FOLLOWED)


@functools.cache
def _names(code) -> frozenset:
    """The names a function's code reads (globals, attributes, modules it imports) and the strings it
    writes, with those of the functions, lambdas and comprehensions inside it."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
        elif isinstance(const, str):
            names |= PROCESS_ARGUMENTS.intersection([const])
        elif isinstance(const, (tuple, frozenset)):     # a list literal's strings come as one tuple
            names |= PROCESS_ARGUMENTS.intersection(const)
    return frozenset(names)


_VERDICTS: dict = {}      # object -> whether it starts a process (objects whose walk is over)


class _Walk:
    """The objects whose walk is under way, and whether the current verdict leaned on one of them."""

    def __init__(self):
        self.open, self.leaned = set(), False


def _starts_process(obj, walk: _Walk) -> bool:
    """Whether `obj` (a function, class or module a test names) starts a process, following the
    functions of FOLLOWED it names. A name met again while its own walk is under way counts as no
    (that walk answers for it); a "no" that leaned on such an open walk is not kept."""
    obj = getattr(obj, "__func__", obj)                 # a bound method: its function
    try:
        if obj in _VERDICTS:
            return _VERDICTS[obj]
    except TypeError:                                   # unhashable: nothing a test calls
        return False
    key = id(obj)
    if key in walk.open:
        walk.leaned = True
        return False
    outer, walk.leaned = walk.leaned, False
    walk.open.add(key)
    verdict = _verdict(obj, walk)
    walk.open.discard(key)
    if verdict or not walk.leaned:
        _VERDICTS[obj] = verdict
    walk.leaned = outer or walk.leaned
    return verdict


def _verdict(obj, walk: _Walk) -> bool:
    if isinstance(obj, types.ModuleType):
        return _starter_module(obj.__name__)
    if callable(obj) and _starter_module(getattr(obj, "__module__", None) or ""):
        return True                                 # e.g. `from subprocess import run`
    if (getattr(obj, "__module__", None), getattr(obj, "__name__", None)) in PROCESS_HELPERS:
        return True
    if isinstance(obj, type):
        return _followed(obj) and any(_starts_process(member, walk) for member in vars(obj).values()
                                      if inspect.isfunction(member))
    func = inspect.unwrap(obj) if callable(obj) else obj
    if callable(func) and not inspect.isfunction(func) and _followed(type(func)):
        return _starts_process(type(func), walk)         # an instance whose class starts processes
    if not inspect.isfunction(func) or not _followed(func):
        return False
    names = _names(func.__code__)
    if any(_starter_module(name) or name in PROCESS_ARGUMENTS for name in names):
        return True                                     # `subprocess.run`, `import subprocess` inside
    scope = dict(func.__globals__)
    if func.__closure__:
        scope.update(zip(func.__code__.co_freevars, (_cell(cell) for cell in func.__closure__)))
    for name in names:
        target = scope.get(name) or _inside_import(name)
        if target is None:
            continue
        if _starts_process(target, walk):
            return True
        if isinstance(target, types.ModuleType) and _followed(target):   # `launcher.run_workers`
            if any(_starts_process(vars(target).get(attr), walk) for attr in names):
                return True
    return False


def _inside_import(name: str):
    """A module a function imports inside itself (`from tools.bench_train import trainer_row`): the
    suite's and tools/' own are imported here to be read; others only when already imported."""
    if name in sys.modules or not name.startswith(("tests.", "tools.")):
        return sys.modules.get(name)
    try:
        return importlib.import_module(name)
    except Exception:                                   # a module that cannot import: nothing to follow
        return None


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:                                  # an empty cell
        return None


def _kind(item) -> str:
    explicit = [kind for kind in KINDS if item.get_closest_marker(kind)]
    if explicit:
        return explicit[0]
    path = Path(str(item.path)).resolve()
    if path.is_relative_to(REPO) and path.relative_to(REPO).as_posix() in INTEGRATION_MODULES:
        return "integration"
    function = getattr(item, "function", None)
    if function is not None and _starts_process(function, _Walk()):
        return "integration"
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for definitions in fixtures.values():
        if any(_starts_process(definition.func, _Walk()) for definition in definitions):
            return "integration"
    return "unit"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """The whole suite on a CPU machine runs on two pytest-xdist workers: the integration tests one
    after another on one of them (each already keeps the cores busy with its processes, and the
    launches shared between modules stay shared: tests/parallel/launcher.py), the unit tests beside
    them a module at a time. The unit tests then take no wall time of their own (they took ~5 of the
    suite's 21 minutes on 2 cores). A run of some tests, a worker, a `-n` given, `--pdb`, a GPU machine
    or no xdist: one process, as before."""
    if hasattr(config, "workerinput"):
        # a worker parses the command line again, without the options set below: it is told to group
        config.option.loadgroup = config.workerinput.get("gdn_loadgroup", False)
        return
    if (getattr(config.option, "numprocesses", "absent") is not None or torch.cuda.is_available()
            or config.getoption("collectonly") or config.getoption("usepdb")):
        return
    if [Path(arg).resolve() for arg in config.args] != [REPO / "tests"]:
        return
    config.option.numprocesses, config.option.dist, config.option.tx = 2, "loadgroup", ["popen"] * 2


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist (controller): tell each worker whether the suite runs grouped (pytest_configure)."""
    node.workerinput["gdn_loadgroup"] = node.config.option.dist == "loadgroup"


@pytest.hookimpl(tryfirst=True)   # before xdist's worker reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            item.add_marker(_kind(item))
        # pytest_configure's split; without xdist the mark is inert
        group = "processes" if item.get_closest_marker("integration") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
