"""A config field's help, range rule and choices are declared once, in its dataclass field's metadata
(gdn_parallel/config.py `setting`), and read from there by the validation errors, `gdn-train
--print-config` and `gdn-train --help-config` / `--help`."""
import dataclasses
import re

import pytest

from gdn_parallel.config import Config, ConfigError, Rule, setting
from gdn_parallel.train.__main__ import build_parser, main
from gdn_parallel.train.commented_config import commented_yaml

SECTION_CLASSES = {section.name: type(getattr(Config(), section.name))
                   for section in dataclasses.fields(Config)}
EVERY_FIELD = [(section, field) for section, cls in SECTION_CLASSES.items()
               for field in dataclasses.fields(cls)]
FIELD_LINE = re.compile(r"^  (\w+): (.*?)(?:  # (.+))?$")

# A value outside the range of each field with a range rule (test_every_range_rule_has_a_bad_value
# keeps it complete), each of the field's type so that only the range fails.
OUT_OF_RANGE = {
    "model.vocab_size": 0, "model.hidden_size": 0, "model.n_layers": 0, "model.gdn_num_heads": 0,
    "model.gdn_num_v_heads": 0, "model.gdn_head_dim": 0, "model.gdn_expand_v": -1.0,
    "model.gdn_chunk_size": 48, "model.kda_num_heads": 0, "model.kda_num_v_heads": 0, "model.kda_head_dim": 0,
    "model.kda_expand_v": -1.0, "model.kda_chunk_size": 48,
    "model.conv_size": 9, "model.attn_num_heads": 0, "model.attn_num_kv_heads": 0, "model.attn_head_dim": 0,
    "model.attn_rotary_dim": -2,
    "model.window_size": 0, "model.rope_theta": 0.0, "model.hidden_ratio": float("nan"),
    "model.intermediate_size": 0, "model.norm_eps": 0.0, "model.initializer_range": -0.02,
    "data.source": "  ", "data.val_fraction": 1.0, "data.seed": 2 ** 64, "data.text_suffixes": "txt",
    "train.seq_len": 1, "train.batch_size": 0, "train.microbatch_size": -1, "train.steps": 0, "train.lr": 0.0,
    "train.min_lr_ratio": 1.5, "train.warmup_steps": -1, "train.decay_fraction": 0.0,
    "train.weight_decay": float("inf"), "train.beta1": 1.0, "train.beta2": -0.1, "train.grad_clip": -1.0,
    "train.seed": -2 ** 63 - 1, "train.log_every": 0, "train.eval_every": -1, "train.eval_rows": 0,
    "train.threads": -1, "train.peak_tflops": -1.0, "train.max_skipped_steps": 0,
    "train.activation_offload_blocks": -1, "train.recompute_chunks": 0,
    "train.collective_timeout_s": 0.5,
    "parallel.tp": 0, "parallel.pp": 0, "parallel.cp": 0, "parallel.dp": 0, "parallel.virtual_stages": 0,
    "checkpoint.interval": -1, "checkpoint.keep": -1,
}


def printed_help(text: str) -> dict[str, str]:
    """{section.field: its comment} of commented YAML, the comment beside the field or, for a long one,
    the comment lines above it joined."""
    helped, above, section = {}, [], None
    for line in text.splitlines():
        if re.fullmatch(r"\w+:", line):
            section, above = line[:-1], []
        elif line.startswith("  # "):
            above.append(line[4:])
        elif match := FIELD_LINE.match(line):
            helped[f"{section}.{match.group(1)}"] = match.group(3) or " ".join(above)
            above = []
    return helped


def validate(section: str, **values):
    """A section of defaults but for `values`, validated."""
    part = SECTION_CLASSES[section](**values)
    part.validate()
    return part


def test_every_field_has_help_and_every_section_a_docstring():
    for section, field in EVERY_FIELD:
        assert field.metadata.get("help", "").strip(), f"{section}.{field.name} has no help"
    for name, cls in SECTION_CLASSES.items():
        generated = cls.__name__ + "("  # what dataclass writes for a class without a docstring
        assert cls.__doc__ and not cls.__doc__.startswith(generated), f"section {name} has no docstring"


def test_every_range_rule_has_a_bad_value():
    ruled = {f"{section}.{field.name}" for section, field in EVERY_FIELD
             if field.metadata["rule"] is not None}
    assert ruled == set(OUT_OF_RANGE)


@pytest.mark.parametrize("key", sorted(OUT_OF_RANGE))
def test_a_range_rule_reads_the_same_in_its_error_and_in_print_config(key):
    section, name = key.split(".")
    field = next(f for f in dataclasses.fields(SECTION_CLASSES[section]) if f.name == name)
    rule, help_text = field.metadata["rule"], field.metadata["help"]
    bad = OUT_OF_RANGE[key]
    with pytest.raises(ConfigError) as info:
        validate(section, **{name: bad})
    assert str(info.value) == f"{key}={bad!r} {rule.requirement}: {help_text}"
    printed = printed_help(commented_yaml(Config()))[key]
    assert rule.requirement in printed and help_text in printed


@pytest.mark.parametrize("section, field", [(s, f) for s, f in EVERY_FIELD if f.metadata["choices"]],
                         ids=lambda value: getattr(value, "name", value))
def test_choices_read_the_same_in_the_error_and_in_print_config(section, field):
    choices = field.metadata["choices"]
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{field.name}='nope' is not supported; choose "
                                                    f"one of {choices}")):
        validate(section, **{field.name: "nope"})
    printed = printed_help(commented_yaml(Config()))[f"{section}.{field.name}"]
    assert "one of " + " | ".join(choices) in printed and field.metadata["help"] in printed


# (section, field, bad value, the start of the error as the tables it replaced wrote it)
OLD_RANGE_ERRORS = [
    ("model", "vocab_size", 0, "model.vocab_size=0 must be >= 1: the number of token ids (256 for bytes)"),
    ("data", "val_fraction", 1.0,
     "data.val_fraction=1.0 must be in [0, 1): the share of documents held out for validation, e.g. 0.02"),
    ("train", "decay_fraction", 0.0, "train.decay_fraction=0.0 must be in (0, 1]: the share of train.steps"),
    ("parallel", "virtual_stages", 0,
     "parallel.virtual_stages=0 must be >= 1: pipeline stages per pp rank (1 with the 1f1b schedule)"),
    ("checkpoint", "keep", -1,
     "checkpoint.keep=-1 must be >= 0: the newest complete checkpoints kept (0: all)"),
]


@pytest.mark.parametrize("section,name,bad,error", OLD_RANGE_ERRORS)
def test_the_old_range_errors_read_as_before(section, name, bad, error):
    """The errors' text is the rule's requirement and the field's help, as the tables it replaced wrote it."""
    with pytest.raises(ConfigError, match="^" + re.escape(error)):
        validate(section, **{name: bad})


def test_a_null_optional_field_has_no_range_to_test():
    validate("model", gdn_num_v_heads=None, attn_head_dim=None)   # null: no range to test


LONG_HELP = " ".join(["which mode"] + ["at some length"] * 8)


def test_print_config_reads_metadata_not_source():
    """A section made at run time has no source to parse: its help still comes out, beside or above."""
    section = dataclasses.make_dataclass("Knobs", [
        ("width", int, setting(3, "how wide", rule=Rule(lambda value: value >= 1, "must be >= 1"))),
        ("mode", str, setting("a", LONG_HELP, choices=("a", "b")))])
    section.__doc__ = "Knobs made at run time."
    outer = dataclasses.make_dataclass("Outer",
                                       [("knobs", section, dataclasses.field(default_factory=section))])
    printed = commented_yaml(outer())
    assert printed.startswith("# Knobs made at run time.\nknobs:\n  width: 3  # how wide; must be >= 1\n")
    assert printed_help(printed)["knobs.mode"] == LONG_HELP + "; one of a | b"


def test_help_config_lists_every_field_with_its_default_and_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help-config"])
    assert exited.value.code == 0
    listing = capsys.readouterr().out
    listed = re.findall(r"^  (\w+\.\w+)=(.*)$", listing, flags=re.MULTILINE)
    assert [key for key, _ in listed] == [f"{section}.{field.name}" for section, field in EVERY_FIELD]
    assert dict(listed)["train.lr"] == "0.003" and dict(listed)["train.out_dir"] == "''"
    entries = re.split(r"^  \w+\.\w+=.*\n", listing, flags=re.MULTILINE)[1:]
    for (section, field), entry in zip(EVERY_FIELD, entries):
        text = " ".join(entry.split())
        assert field.metadata["help"] in text, f"{section}.{field.name}"
        if field.metadata["rule"] is not None:
            assert field.metadata["rule"].requirement in text


def test_help_config_of_one_section(capsys):
    with pytest.raises(SystemExit):
        main(["--help-config", "checkpoint"])
    listing = capsys.readouterr().out
    assert listing.startswith("[checkpoint] Checkpoints under <train.out_dir>/checkpoints/")
    assert re.findall(r"^  (\S+)=", listing, flags=re.MULTILINE) == [
        "checkpoint.interval", "checkpoint.keep", "checkpoint.async_save", "checkpoint.enabled",
        "checkpoint.verify", "checkpoint.allow_other_run"]
    with pytest.raises(SystemExit) as exited:
        main(["--help-config", "modle"])
    assert exited.value.code == 2 and "invalid choice: 'modle'" in capsys.readouterr().err


def test_help_names_every_section_and_help_config():
    text = build_parser().format_help()
    assert "--help-config [SECTION]" in text
    for name, cls in SECTION_CLASSES.items():
        assert re.search(rf"^  {name} +{re.escape(cls.__doc__.split()[0])} ", text, flags=re.MULTILINE), name
