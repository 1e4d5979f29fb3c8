"""Every config field with its help: a config as commented YAML (`gdn-train --print-config`) and the
table of the fields with their defaults (`gdn-train --help-config [SECTION]`).

Both read what gdn_parallel/config.py declares, the source its validation errors read too: each
section's docstring and each field's metadata (`setting`: its help, its range rule, its choices).
The YAML reads back as the same config (`gdn-train --config printed.yaml`).
"""
from __future__ import annotations

import dataclasses
import inspect
import textwrap

import yaml

from ..config import Config

INDENT = "  "
WIDTH = 110  # the lines of the YAML and of the table; a longer help goes on comment lines of its own


def section_names() -> list[str]:
    return [section.name for section in dataclasses.fields(Config)]


def section_help(part) -> str:
    """The section's docstring (each section class has one: the generated one of a dataclass without
    it would only repeat the fields)."""
    return inspect.cleandoc(type(part).__doc__ or "")


def field_limits(field: dataclasses.Field) -> str:
    """What the field takes besides its type: its range rule's requirement or its choices ('' when
    neither)."""
    rule, choices = field.metadata.get("rule"), field.metadata.get("choices", ())
    if rule is not None:
        return rule.requirement
    return "one of " + " | ".join(map(str, choices)) if choices else ""


def field_text(field: dataclasses.Field) -> str:
    """The field's help followed by its limits."""
    return "; ".join(text for text in (field.metadata["help"], field_limits(field)) if text)


def commented_yaml(config: Config, header: str = "") -> str:
    """config as YAML, each field with its help (module docstring); `header`: comment lines on top."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section in dataclasses.fields(config):
        part = getattr(config, section.name)
        lines += [f"# {line}" if line else "#" for line in section_help(part).splitlines()]
        lines.append(f"{section.name}:")
        for field in dataclasses.fields(part):
            entry, text = f"{INDENT}{field.name}: {_flow(getattr(part, field.name))}", field_text(field)
            if len(entry) + len("  # ") + len(text) <= WIDTH:
                lines.append(f"{entry}  # {text}")
            else:
                lines += _wrap(text, f"{INDENT}# ")
                lines.append(entry)
    return "\n".join(lines) + "\n"


def fields_table(section: str | None = None) -> str:
    """Every field of `section` (of all sections when None) as `section.field=default` and its help
    below, under each section's docstring: the defaults, not a config file's values."""
    defaults = Config()
    lines: list[str] = []
    for name in section_names():
        if section not in (None, name):
            continue
        part = getattr(defaults, name)
        title = f"[{name}] "
        lines += [""] if lines else []
        lines += textwrap.wrap(" ".join(section_help(part).split()), WIDTH, initial_indent=title,
                               subsequent_indent=" " * len(title), break_on_hyphens=False)
        for field in dataclasses.fields(part):
            lines.append(f"{INDENT}{name}.{field.name}={_flow(getattr(part, field.name))}")
            lines += _wrap(field_text(field), INDENT * 3)
    return "\n".join(lines) + "\n"


def sections_overview() -> str:
    """One entry a section, its name and docstring (`gdn-train --help`)."""
    defaults, column = Config(), 14
    return "\n".join(textwrap.fill(" ".join(section_help(getattr(defaults, name)).split()), WIDTH,
                                   initial_indent=f"  {name:<{column - 2}}", subsequent_indent=" " * column,
                                   break_on_hyphens=False)
                     for name in section_names())


def _wrap(text: str, prefix: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=prefix, subsequent_indent=prefix,
                         break_long_words=False, break_on_hyphens=False)


def _flow(value) -> str:
    """One-line YAML of a value (lists and mappings in flow style), as it reads back."""
    dumped = yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()
    return dumped[1:-1]  # [value] -> value
