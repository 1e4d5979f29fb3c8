"""What cannot be converted fails with exit status 2, a message naming what differs, and nothing
written: features fla's format cannot express, missing shards, vocabulary and config mismatches,
unknown formats, incomplete checkpoints, existing outputs."""
import dataclasses
import json
import random
import shutil
import struct
import sys

import pytest
import torch

from gdn_parallel.config import ModelConfig
from gdn_parallel.convert.__main__ import main
from gdn_parallel.convert.errors import ConvertError
from gdn_parallel.convert.hf_format import EMBEDDED, derived_model_config, format_refusals, hf_config
from gdn_parallel.convert.safetensors_io import INDEX_FILE
from gdn_parallel.model import HybridLM

TINY = dict(vocab_size=256, hidden_size=32, n_layers=2, layer_pattern="GS", gdn_num_heads=2, gdn_head_dim=8,
            attn_num_heads=4, window_size=8)


def fails(capsys, argv, *needles) -> str:
    """Runs the command, expects status 2 and every needle in the message; returns the message."""
    assert main(argv) == 2
    message = capsys.readouterr().err
    for needle in needles:
        assert needle in message, message
    return message


def nothing_written(parent, name) -> bool:
    return not (parent / name).exists() and not list(parent.glob(f".{name}.partial-*"))


def torch_file(path, **changes):
    config = ModelConfig(**{**TINY, **changes})
    torch.save({"model": HybridLM(config).state_dict(), "config": dataclasses.asdict(config)}, path)
    return path


@pytest.mark.parametrize("changes, needle", [
    ({"attn_output_gate": True}, "model.attn_output_gate"),
    ({"conv_bias": True}, "model.conv_bias"),
    ({"attn_head_dim": 16}, "model.attn_head_dim"),
    ({"attn_qk_norm": True}, "model.attn_qk_norm"),
    ({"attn_rotary_dim": 4}, "model.attn_rotary_dim"),
    ({"attn_rotary_dim": 0}, "model.attn_rotary_dim"),
])
def test_what_fla_cannot_express_is_refused_by_name(changes, needle):
    model = ModelConfig(**{**TINY, **changes})
    assert any(needle in reason for reason in format_refusals(model))
    with pytest.raises(ConvertError, match=needle):
        hf_config(model, torch.float32)


def test_both_attention_kinds_and_qkv_bias_are_expressed():
    model = ModelConfig(**{**TINY, "n_layers": 3, "layer_pattern": "GSA", "attn_qkv_bias": True})
    hf = hf_config(model, torch.float32)
    common = {"num_heads": 4, "num_kv_heads": 4, "qkv_bias": True, "rope_theta": 10000.0}
    assert hf["attn"] == [{"layers": [1], **common, "window_size": 8},
                          {"layers": [2], **common, "window_size": None}]
    assert derived_model_config(hf, "x").layer_types == "GSA"


@pytest.mark.parametrize("field, value, needle", [
    ("use_short_conv", False, "use_short_conv"), ("hidden_act", "gelu", "hidden_act"),
    ("output_gate_activation", "sigmoid", "output_gate_activation"),
    ("attnres_block_size", 2, "attnres_block_size"),
    ("head_dim", 256, "model.gdn_head_dim is head_dim"),   # value head 512: above the kernels' limit
    ("attn", [{"layers": [0], "num_heads": 4, "window_size": 8}, {"layers": [1], "num_heads": 2}],
     "attn specs differ"),
])
def test_fla_models_we_cannot_build_are_refused_by_name(field, value, needle):
    hf = {**hf_config(ModelConfig(**TINY), torch.float32), field: value}
    with pytest.raises(ConvertError, match=needle):
        derived_model_config(hf, "config.json")


def test_export_of_an_inexpressible_model_writes_nothing(tmp_path, capsys):
    source = torch_file(tmp_path / "gated.pt", attn_output_gate=True)
    assert main(["from-torch", str(source), str(tmp_path / "dcp")]) == 0
    fails(capsys, ["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")], "attn_output_gate", "g_proj")
    assert nothing_written(tmp_path, "hf")


def test_missing_shard_vocabulary_and_config_mismatches(hybrid_checkpoint, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["to-hf", str(hybrid_checkpoint), str(hf), "--shard-size", "20KB"]) == 0
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    lost = sorted(set(json.loads((hf / INDEX_FILE).read_text())["weight_map"].values()))[1]
    (broken / lost).unlink()
    fails(capsys, ["from-hf", str(broken), str(tmp_path / "a")], "missing shard", lost)
    assert nothing_written(tmp_path, "a")

    config = json.loads((hf / "config.json").read_text())
    edited = tmp_path / "edited"
    shutil.copytree(hf, edited)
    (edited / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    fails(capsys, ["from-hf", str(edited), str(tmp_path / "b")], "model.vocab_size", "300", EMBEDDED)
    (edited / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != EMBEDDED},
                                                    "vocab_size": 300}))
    fails(capsys, ["from-hf", str(edited), str(tmp_path / "b")], "vocabulary mismatch", "256", "300")
    assert nothing_written(tmp_path, "b")

    other = tmp_path / "other.yaml"
    other.write_text("model:\n  hidden_size: 64\n  n_layers: 3\n  layer_pattern: GSA\n")
    fails(capsys, ["from-hf", str(hf), str(tmp_path / "c"), "--config", str(other)],
          "model config mismatch", "model.hidden_size", "32", "64")
    assert nothing_written(tmp_path, "c")


def test_data_outside_the_vocabulary_is_refused(tmp_path, capsys):
    source = torch_file(tmp_path / "small.pt", vocab_size=128)   # the default data are bytes: ids up to 255
    fails(capsys, ["from-torch", str(source), str(tmp_path / "dcp")], "model.vocab_size=128")
    assert nothing_written(tmp_path, "dcp")


def test_unknown_formats_and_incomplete_checkpoints(hybrid_checkpoint, tmp_path, capsys):
    fails(capsys, ["to-hf", str(tmp_path), str(tmp_path / "x")], "not a gdn_parallel checkpoint")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fails(capsys, ["from-hf", str(tmp_path / "llama"), str(tmp_path / "x")], "'llama'", "gated_deltanet")
    (tmp_path / "state.pt").write_bytes(b"not a torch file")
    fails(capsys, ["from-torch", str(tmp_path / "state.pt"), str(tmp_path / "x")], "not a torch file")
    torch.save({"weight": torch.zeros(2)}, tmp_path / "bare.pt")
    fails(capsys, ["from-torch", str(tmp_path / "bare.pt"), str(tmp_path / "x")], "bare state dict",
          "--config")
    torch.save({"model": {"weight": torch.zeros(2)}, "cfg": {}}, tmp_path / "other.pt")
    fails(capsys, ["from-torch", str(tmp_path / "other.pt"), str(tmp_path / "x")], "'model'", "'config'",
          "'cfg'")
    assert main(["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf")]) == 0
    fails(capsys, ["from-torch", str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "x")], "from-hf")
    fails(capsys, ["to-hf", str(tmp_path / "hf"), str(tmp_path / "x")], "Hugging Face folder", "from-hf")
    fails(capsys, ["from-hf", str(hybrid_checkpoint), str(tmp_path / "x")], "no config.json", "to-hf")
    run = tmp_path / "interrupted-run"
    shutil.copytree(hybrid_checkpoint, run / "checkpoints" / "step_3.partial")
    fails(capsys, ["to-hf", str(run), str(tmp_path / "x")], "holds no complete checkpoint", "step_3.partial")

    incomplete = tmp_path / "incomplete"
    shutil.copytree(hybrid_checkpoint, incomplete)
    (incomplete / "COMPLETE").unlink()
    fails(capsys, ["to-torch", str(incomplete), str(tmp_path / "x.pt")], "not a complete checkpoint")
    (incomplete / "COMPLETE").write_text("")
    for data_file in incomplete.glob("*.distcp"):
        data_file.unlink()
    fails(capsys, ["to-torch", str(incomplete), str(tmp_path / "x.pt")], "fails verification",
          "__0_0.distcp: missing")
    assert nothing_written(tmp_path, "x") and nothing_written(tmp_path, "x.pt")


def test_an_existing_output_is_never_overwritten(hybrid_checkpoint, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep")
    fails(capsys, ["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf")], "already exists")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["mine.txt"]
    fails(capsys, ["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf2"), "--shard-size", "lots"],
          "--shard-size")


def test_a_conversion_that_fails_midway_leaves_nothing(hybrid_checkpoint, tmp_path, monkeypatch):
    from gdn_parallel.convert import commands

    def write_then_fail(folder, tensors, max_bytes):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(commands, "write_folder", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        commands.to_hf(hybrid_checkpoint, tmp_path / "new" / "parents" / "hf")
    assert list(tmp_path.iterdir()) == []   # no folder, no temporary, no parent it created


def test_a_safetensors_header_length_past_the_file_is_named_not_allocated(hybrid_checkpoint, tmp_path,
                                                                          capsys):
    """A damaged header length (here 2**62) used to be read as asked: a MemoryError."""
    assert main(["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf")]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 2 ** 62) + weights.read_bytes()[8:])
    fails(capsys, ["from-hf", str(tmp_path / "hf"), str(tmp_path / "x")], str(weights), "damaged header",
          "exceeds the")
    assert nothing_written(tmp_path, "x")


# unpickling these bytes fails with UnpicklingError, IndexError, KeyError
@pytest.mark.parametrize("seed", [0, 2, 20])
def test_random_bytes_as_a_torch_file_are_named(tmp_path, capsys, seed):
    """Random bytes used to end in a traceback (IndexError, KeyError) from the unpickler."""
    noise = tmp_path / "noise.pt"
    noise.write_bytes(random.Random(seed).randbytes(4096))
    fails(capsys, ["from-torch", str(noise), str(tmp_path / "x")], str(noise),
          "is not a torch file of tensors")


def test_without_the_safetensors_library_the_commands_say_what_to_install(hybrid_checkpoint, tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    fails(capsys, ["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf")],
          "pip install 'gdn-parallel[convert]'")
    assert nothing_written(tmp_path, "hf")


@pytest.mark.parametrize("damage", ["random bytes", "a header that is not JSON", "truncated data"])
def test_a_damaged_safetensors_file_is_named_in_one_line(hybrid_checkpoint, tmp_path, capsys, damage):
    assert main(["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf")]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes({"random bytes": random.Random(0).randbytes(4096),
                         "a header that is not JSON": struct.pack("<Q", 64) + b"{" + bytes(range(100)),
                         "truncated data": raw[:-100]}[damage])
    message = fails(capsys, ["from-hf", str(tmp_path / "hf"), str(tmp_path / "x")], str(weights),
                    "is not a readable safetensors file")
    assert message.count("\n") == 1 and nothing_written(tmp_path, "x")
