"""The package imports in one direction only (docs/design.md §4): every import, at module level or
inside a function, goes from a layer to one below it (or stays inside its own unit).

    config | kernels (gdn_kernels) | comm  -> ops -> model | data -> parallel
        -> checkpoint | runtime -> train | convert | verify -> evaluate

Units side by side in one layer do not import each other. The kernels are a leaf that imports
torch and triton only; the communication layer torch only (torch.distributed)."""
import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {
    "gdn_parallel.config": 0, "gdn_kernels": 0, "gdn_parallel.comm": 0,
    "gdn_parallel.ops": 1,
    "gdn_parallel.model": 2, "gdn_parallel.data": 2,
    "gdn_parallel.parallel": 3,
    "gdn_parallel.checkpoint": 4, "gdn_parallel.runtime": 4,
    "gdn_parallel.train": 5, "gdn_parallel.convert": 5, "gdn_parallel.verify": 5,
    "gdn_parallel.evaluate": 6,
}
# What a leaf may import besides the standard library and its own unit.
LEAF_IMPORTS = {"gdn_kernels": {"torch", "triton"}, "gdn_parallel.comm": {"torch"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "kernels":
        parts[0] = "gdn_kernels"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str):
    for unit in sorted(LAYERS, key=len, reverse=True):
        if module == unit or module.startswith(unit + "."):
            return unit
    return None


def imports_of(path: Path):
    """(imported module, line) for every import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target, node.lineno


def package_files():
    files = sorted((REPO / "gdn_parallel").rglob("*.py")) + sorted((REPO / "kernels").rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def test_every_module_belongs_to_a_layer():
    orphans = [module_name(f) for f in package_files()
               if unit_of(module_name(f)) is None and module_name(f) != "gdn_parallel"]
    assert not orphans, f"modules outside every layer of tests/test_layering.py: {orphans}"


@pytest.mark.parametrize("path", package_files(), ids=lambda p: module_name(p))
def test_imports_follow_the_layers(path):
    source = unit_of(module_name(path))
    if source is None:  # the package root
        return
    stdlib = sys.stdlib_module_names
    for target, line in imports_of(path):
        top = target.split(".")[0]
        target_unit = unit_of(target)
        where = f"{path.relative_to(REPO)}:{line} imports {target}"
        if source in LEAF_IMPORTS and target_unit != source:
            assert top in stdlib or top in LEAF_IMPORTS[source] or top == "__future__", \
                f"{where}: {source} is a leaf and imports only {sorted(LEAF_IMPORTS[source])} and the " \
                "standard library"
        if target_unit == source:
            continue
        if target_unit is None:  # a third-party module (or the package roots, which import nothing)
            assert (top not in ("gdn_parallel", "gdn_kernels")
                    or target in ("gdn_parallel", "gdn_kernels")), where
            continue
        assert LAYERS[target_unit] < LAYERS[source], \
            f"{where}: layer {LAYERS[source]} ({source}) may import only layers below it, not " \
            f"{target_unit} (layer {LAYERS[target_unit]})"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: an upward import hidden inside a function is caught."""
    fake = REPO / "gdn_parallel" / "ops" / "_layering_probe.py"
    assert not fake.exists()
    monkeypatch.setattr(Path, "read_text",
                        lambda self, encoding=None: "def f():\n    from ..parallel import mesh\n")
    found = list(imports_of(fake))
    assert found == [("gdn_parallel.parallel", 2)]
    assert LAYERS[unit_of(found[0][0])] > LAYERS[unit_of(module_name(fake))]
