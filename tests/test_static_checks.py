"""The linter and the type checker, with the project's own settings (pyproject.toml), pass on the tree.

ruff: the named rule set at line length 110 over every Python file. mypy: the public API, the library
layers users build on (`[tool.mypy] files`); and the shape rules of issue 29 (function length, parameters
of the training loop's helpers). Both tools come with the dev extras the README's test
command installs; a missing one fails here rather than passing unchecked."""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    if "No module named" in done.stderr:
        raise AssertionError(f"{tool} is not installed: install the dev extras "
                             f"(python3 -m pip install torch==2.13.0 -e \".[dev]\")")
    return done


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_mypy_finds_nothing_in_the_public_api(tmp_path):
    done = _run("mypy", "--cache-dir", str(tmp_path / "mypy_cache"))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def _functions(folder: str):
    """(where, lines, parameters besides self/cls) of every function under gdn_parallel/<folder>."""
    for path in sorted((REPO / "gdn_parallel" / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                count = len(names) - (names[:1] in (["self"], ["cls"]))
                where = f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
                yield where, node.end_lineno - node.lineno + 1, count


def test_no_function_of_the_package_is_longer_than_60_lines():
    # The Triton kernels (kernels/, the gdn_kernels package) are outside: a kernel body is one unit.
    assert [(where, lines) for where, lines, _ in _functions("") if lines > 60] == []


def test_the_training_loop_helpers_take_at_most_5_parameters():
    assert [(where, count) for where, _, count in _functions("train") if count > 5] == []
