"""Facts the package states once (issue 29): each has one owner, and no other module spells it out
again. Each test reads the package's source (AST), so a second copy fails here when it is written,
not later when the two disagree."""
import ast
from pathlib import Path

from gdn_parallel.checkpoint.manager import LAYOUT_DEGREES
from gdn_parallel.parallel.mesh import MESH_DIMS

PACKAGE = Path(__file__).resolve().parents[1] / "gdn_parallel"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _string_collections(tree):
    """(line, the strings) of every tuple, list or set literal made of string constants only."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            yield node.lineno, [e.value for e in node.elts]


def _found(owner: str, matches) -> list:
    """Where, outside `owner`, a string collection satisfies `matches`."""
    return [f"{name}:{line} {values}" for name, tree in _modules() if name != owner
            for line, values in _string_collections(tree) if matches(values)]


def test_the_mesh_order_is_stated_once():
    # Another order of the four names is another fact (verify/layouts.py lists pure tp layouts first).
    assert _found("gdn_parallel/parallel/mesh.py", lambda values: tuple(values) == MESH_DIMS) == []
    # ... nor as the degrees read in that order, e.g. a mesh shape
    # (config.pp, config.dp, config.cp, config.tp)
    shapes = [f"{name}:{node.lineno}" for name, tree in _modules() for node in ast.walk(tree)
              if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == len(MESH_DIMS)
              and all(isinstance(e, ast.Attribute) for e in node.elts)
              and tuple(e.attr for e in node.elts) == MESH_DIMS]
    assert shapes == []
    assert LAYOUT_DEGREES is MESH_DIMS     # a checkpoint's layout record names the mesh's dimensions


def test_the_pipeline_schedule_names_are_stated_once():
    names = {"1f1b", "interleaved"}
    assert _found("gdn_parallel/config.py", lambda values: names <= set(values)) == []


def test_one_function_writes_the_layout_record():
    """Only checkpoint.manager.layout_record builds a dict keyed by the layout's world size."""
    builders = [f"{name}:{node.lineno}" for name, tree in _modules() for node in ast.walk(tree)
                if isinstance(node, ast.Dict)
                and any(isinstance(k, ast.Constant) and k.value == "world_size" for k in node.keys)]
    assert len(builders) == 1 and builders[0].startswith("gdn_parallel/checkpoint/manager.py"), builders


def test_the_trainer_takes_the_checkpoint_path_from_the_saver():
    """The trainer prints and records the path CheckpointSaver.save returns; it never rebuilds it."""
    calls = [f"{name}:{node.lineno}" for name, tree in _modules() if name.startswith("gdn_parallel/train/")
             for node in ast.walk(tree)
             if isinstance(node, ast.Name) and node.id in ("final_path", "partial_path")]
    assert calls == []


def test_the_lr_schedules_implemented_are_the_ones_the_config_offers():
    """config.LR_SCHEDULES (the choices a config is checked against) names what train/schedule.py
    implements: each schedule's function and the fields a resume compares for it, nothing more."""
    from gdn_parallel.config import DECAY_SHAPES, LR_SCHEDULES
    from gdn_parallel.train.schedule import AFTER_WARMUP, DECAY_SCALES, READS

    assert set(AFTER_WARMUP) == set(READS) == set(LR_SCHEDULES)
    assert set(DECAY_SCALES) == set(DECAY_SHAPES)
