"""A config as YAML with every field's help beside it (`gdn-train --print-config`).

The help lives in gdn_parallel/config.py and is read from there, so it cannot drift from the code:
each section's docstring, the comments above and beside each field (kept where the source has them),
the field's range rule (the `<SECTION>_RULES` tables) and its choices (the `_check_choice` calls of
the section's `validate`). A field with none of these shows its type. The YAML reads back as the
same config (`gdn-train --config printed.yaml`).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize

import yaml

from .. import config as config_module
from ..config import Config

INDENT = "  "


def commented_yaml(config: Config, header: str = "") -> str:
    """config as YAML, each field with its help (module docstring); `header`: comment lines on top."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section in dataclasses.fields(config):
        part = getattr(config, section.name)
        doc, above, beside = _source_help(type(part))
        lines += [f"# {line}" for line in doc.splitlines() if line.strip()]
        lines.append(f"{section.name}:")
        rules = {name: text for name, _, text in getattr(config_module, f"{section.name.upper()}_RULES", ())}
        choices = _choices(type(part))
        for field in dataclasses.fields(part):
            lines += [INDENT + comment for comment in above.get(field.name, [])]
            comment, rule = beside.get(field.name, ""), rules.get(field.name, "")
            if comment and rule:  # the rule's own explanation (after its ':') repeats the comment
                rule = rule.split(": ", 1)[0]
            help_parts = [text for text in (comment, rule) if text]
            said = comment + " ".join(above.get(field.name, []))
            if field.name in choices and not all(str(choice) in said for choice in choices[field.name]):
                help_parts.append("one of " + " | ".join(map(str, choices[field.name])))
            help_text = "; ".join(help_parts) or _type_name(field.type)
            lines.append(f"{INDENT}{field.name}: {_flow(getattr(part, field.name))}  # {help_text}")
    return "\n".join(lines) + "\n"


def _flow(value) -> str:
    """One-line YAML of a value (lists and mappings in flow style), as it reads back."""
    dumped = yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()
    return dumped[1:-1]  # [value] -> value


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _source_help(cls) -> tuple[str, dict[str, list[str]], dict[str, str]]:
    """(cls's docstring, {field: comment lines directly above it}, {field: its end-of-line comment})
    from cls's source (a dataclass without a docstring gets a generated one, which is no help)."""
    source = textwrap.dedent(inspect.getsource(cls))
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {token.start[0]: token.string for token in tokens if token.type == tokenize.COMMENT}
    lines = source.splitlines()
    above: dict[str, list[str]] = {}
    beside: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name, line = node.target.id, node.lineno
        if line in comments:
            beside[name] = comments[line].lstrip("#").strip()
        block, previous = [], line - 1
        while previous in comments and lines[previous - 1].strip().startswith("#"):
            block.insert(0, comments[previous])
            previous -= 1
        if block:
            above[name] = block
    return ast.get_docstring(class_node) or "", above, beside


def _choices(cls) -> dict[str, tuple]:
    """{field: allowed values} of the `_check_choice(self, section, "field", ALLOWED, ...)` calls in
    cls.validate; ALLOWED a name in gdn_parallel.config, an attribute of cls or a literal tuple."""
    validate = getattr(cls, "validate", None)
    if validate is None:
        return {}
    found = {}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(validate)))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_check_choice"
                and len(node.args) >= 4 and isinstance(node.args[2], ast.Constant)):
            continue
        allowed = node.args[3]
        if isinstance(allowed, ast.Name):
            found[node.args[2].value] = tuple(getattr(config_module, allowed.id))
        elif isinstance(allowed, ast.Attribute):
            found[node.args[2].value] = tuple(getattr(cls, allowed.attr))
        else:
            found[node.args[2].value] = tuple(ast.literal_eval(allowed))
    return found
