"""An export carries the tokenizer its checkpoint's data was prepared with (recorded with the data,
carried inside the checkpoint, so a copied checkpoint exports it too): tokenizer.json verbatim,
tokenizer_config.json and generation_config.json that transformers loads, the special token ids in
config.json; byte-level data exports no tokenizer files and null ids; a checkpoint without a record
exports as before. Weights from a folder go on only with data made by the folder's tokenizer."""
import json
import shutil

import pytest
import torch

from gdn_parallel.checkpoint import integrity
from gdn_parallel.convert.__main__ import main
from gdn_parallel.convert.hf_format import EMBEDDED
from gdn_parallel.convert.safetensors_io import read_folder
from tests.tokenized_data import BOS, EOS, PAD, texts

IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}   # tests/tokenized_data.py's specials
NULL_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def exported(checkpoint, folder, capsys) -> str:
    assert main(["to-hf", str(checkpoint), str(folder)]) == 0
    return capsys.readouterr().out


def read_json(path) -> dict:
    return json.loads(path.read_text())


def test_a_bpe_export_holds_the_tokenizer_transformers_loads(bpe_checkpoint, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                                              "(pip install -e '.[dev]')")
    root = bpe_checkpoint.parents[2]
    # the checkpoint travels: the data and the tokenizer file it was prepared from are not needed
    moved = tmp_path / "elsewhere" / "step_1"
    shutil.copytree(bpe_checkpoint, moved)
    original_tokenizer = (root / "tokenizer.json").read_bytes()
    hidden = tmp_path / "hidden"
    shutil.move(str(root), str(hidden))
    try:
        folder = tmp_path / "hf"
        line = exported(moved, folder, capsys)
    finally:
        shutil.move(str(hidden), str(root))
    assert f"bos '{BOS}' = 0, eos '{EOS}' = 1, pad '{PAD}' = 2" in line
    assert (folder / "tokenizer.json").read_bytes() == original_tokenizer
    config = read_json(folder / "config.json")
    assert {key: config[key] for key in IDS} == IDS
    assert config[EMBEDDED]["tokenizer"]["kind"] == "tokenizers"
    assert read_json(folder / "tokenizer_config.json")["tokenizer_class"] == "PreTrainedTokenizerFast"

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    from tokenizers import Tokenizer
    reference = Tokenizer.from_str(original_tokenizer.decode())
    for text in texts(5, seed=1):   # the ids the data were prepared with, and the text back
        assert tokenizer(text).input_ids == reference.encode(text).ids
        assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (0, 1, 2)


def test_a_bpe_export_loads_strictly_into_fla_on_the_meta_device(bpe_checkpoint, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                                              "(pip install -e '.[dev]')")
    fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is not installed")
    folder = tmp_path / "hf"
    exported(bpe_checkpoint, folder, capsys)
    config = transformers.AutoConfig.from_pretrained(folder)
    assert isinstance(config, fla_models.GatedDeltaNetConfig) and config.eos_token_id == 1
    with torch.device("meta"):
        model = fla_models.GatedDeltaNetForCausalLM(config)
    weights = read_folder(folder)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected   # names and shapes
    model.load_state_dict(weights, strict=True, assign=True)
    assert model.generation_config.eos_token_id == 1


def test_a_byte_level_export_has_no_tokenizer_files_and_null_ids(hybrid_checkpoint, tmp_path, capsys):
    folder = tmp_path / "hf"
    assert "byte-level data (ids are UTF-8 bytes" in exported(hybrid_checkpoint, folder, capsys)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json",
                                                        "model.safetensors"]
    config = read_json(folder / "config.json")
    assert {key: config[key] for key in IDS} == NULL_IDS == read_json(folder / "generation_config.json")
    assert config[EMBEDDED]["tokenizer"] == {"kind": "bytes", "vocab_size": 256}


def test_a_checkpoint_without_a_tokenizer_record_exports_as_before(hybrid_checkpoint, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(hybrid_checkpoint, old)
    (old / "tokenizer_info.json").unlink()   # as saved before checkpoints carried it
    recorded = integrity.read_manifest(old)
    integrity.write_manifest(old, {k: v for k, v in recorded.items() if k != "tokenizer_info.json"})
    folder = tmp_path / "hf"
    assert "tokenizer: none (the checkpoint records none" in exported(old, folder, capsys)
    config = read_json(folder / "config.json")
    assert {key: config[key] for key in IDS} == NULL_IDS and config[EMBEDDED]["tokenizer"] is None


def test_weights_go_on_only_with_data_of_their_tokenizer(bpe_checkpoint, hybrid_checkpoint, tmp_path, capsys):
    folder = tmp_path / "hf"
    exported(bpe_checkpoint, folder, capsys)
    # the default data are bytes (this Python's standard library): not what the weights learnt
    assert main(["from-hf", str(folder), str(tmp_path / "dcp")]) == 2
    err = capsys.readouterr().err
    assert "was trained on tokenizer.json sha256" in err and "byte-level ids" in err and "--tokenizer" in err
    assert not (tmp_path / "dcp").exists()
    data = bpe_checkpoint.parents[2] / "data"
    assert main(["from-hf", str(folder), str(tmp_path / "dcp"), "--set", f"data.source={data}"]) == 0
    assert (tmp_path / "dcp" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    # and a byte-level export into BPE data
    exported(hybrid_checkpoint, tmp_path / "bytes-hf", capsys)
    assert main(["from-hf", str(tmp_path / "bytes-hf"), str(tmp_path / "x"), "--set",
                 f"data.source={data}"]) == 2
    assert "byte-level data (text files" in capsys.readouterr().err
