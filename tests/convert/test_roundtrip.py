"""Round trips DCP -> Hugging Face folder -> DCP -> torch file -> DCP are bit-exact (G, S and A layers,
tied embeddings, grouped KV heads, q/k/v biases); the model config survives them; a folder loads into
our model from its files alone and gives the original logits; dtypes change only when asked."""
import json
import shutil

import torch

from gdn_parallel.checkpoint import read_trainer_state
from gdn_parallel.config import Config
from gdn_parallel.convert import model_from_hf
from gdn_parallel.convert.__main__ import main
from gdn_parallel.convert.commands import read_torch_file
from gdn_parallel.convert.hf_format import EMBEDDED
from gdn_parallel.convert.safetensors_io import INDEX_FILE, SINGLE_FILE, read_file, read_folder
from gdn_parallel.model import HybridLM

from .conftest import all_tensors, assert_same_tensors


def model_part(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def original_model(checkpoint) -> HybridLM:
    saved = read_trainer_state(checkpoint)
    model = HybridLM(Config.from_dict({"model": saved["config"]["model"]}).model)
    weights = {k[len("model."):]: v for k, v in model_part(all_tensors(checkpoint)).items()}
    model.load_state_dict(weights, strict=False)  # tied: lm_head is the embedding
    return model.eval()


def logits(model: HybridLM) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def test_round_trips_are_bit_exact_and_keep_the_config(hybrid_checkpoint, tmp_path):
    hf, back, file, again, sharded = (tmp_path / name
                                      for name in ("hf", "dcp", "model.pt", "dcp2", "hf-sharded"))
    assert main(["to-hf", str(hybrid_checkpoint), str(hf)]) == 0
    assert main(["from-hf", str(hf), str(back)]) == 0
    assert main(["to-torch", str(back), str(file)]) == 0
    assert main(["from-torch", str(file), str(again)]) == 0
    assert main(["to-hf", str(again), str(sharded), "--shard-size", "20KB"]) == 0

    original = model_part(all_tensors(hybrid_checkpoint))
    assert_same_tensors(model_part(all_tensors(back)), original)
    assert_same_tensors(model_part(all_tensors(again)), original)
    assert_same_tensors(read_folder(sharded), read_folder(hf))
    assert "lm_head.weight" not in read_folder(hf)  # tied: fla ties it to model.embeddings.weight

    model_config = read_trainer_state(hybrid_checkpoint)["config"]["model"]
    for converted in (back, again):
        state = read_trainer_state(converted)
        assert state["config"]["model"] == model_config and state["step"] == 0
        assert (converted / "config.yaml").is_file()
    config_model, tensors = read_torch_file(file)
    assert vars(config_model) == model_config and sorted(tensors) == sorted(k[6:] for k in original)
    assert json.loads((hf / "config.json").read_text())[EMBEDDED]["model"] == model_config


def test_new_checkpoints_hold_fresh_adamw_slots(hybrid_checkpoint, tmp_path):
    assert main(["to-torch", str(hybrid_checkpoint), str(tmp_path / "m.pt")]) == 0
    assert main(["from-torch", str(tmp_path / "m.pt"), str(tmp_path / "dcp")]) == 0
    tensors = all_tensors(tmp_path / "dcp")
    names = [k[len("model."):] for k in tensors if k.startswith("model.")]
    for name in names:
        for moment in ("exp_avg", "exp_avg_sq"):
            slot = tensors[f"optim.{name}.{moment}"]
            assert (slot.dtype == torch.float32 and not slot.any()
                    and slot.shape == tensors[f"model.{name}"].shape)
        assert tensors[f"optim.{name}.step"].item() == 0  # the first update is a fresh AdamW's
    assert len(tensors) == 4 * len(names)


def test_sharded_folder_follows_the_hub_layout(hybrid_checkpoint, tmp_path):
    folder = tmp_path / "hf"
    assert main(["to-hf", str(hybrid_checkpoint), str(folder), "--shard-size", "20KB"]) == 0
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (folder / SINGLE_FILE).exists()
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    tensors = read_folder(folder)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    try:  # the reference reader, where installed (transformers brings it), reads our files the same
        from safetensors.torch import load_file
    except ImportError:
        return
    for shard in shards:
        assert_same_tensors(load_file(folder / shard), read_file(folder / shard))


def test_a_folder_alone_gives_the_original_logits(hybrid_checkpoint, tmp_path):
    exported = tmp_path / "export"
    assert main(["to-hf", str(hybrid_checkpoint), str(exported)]) == 0
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(exported, moved)   # nothing but the folder's files
    expected = logits(original_model(hybrid_checkpoint))
    assert torch.equal(logits(model_from_hf(moved).eval()), expected)
    # without our embedded config, fla's fields alone describe the same model
    config = json.loads((moved / "config.json").read_text())
    del config[EMBEDDED]
    (moved / "config.json").write_text(json.dumps(config))
    assert torch.equal(logits(model_from_hf(moved).eval()), expected)
    assert main(["from-hf", str(moved), str(tmp_path / "dcp")]) == 0
    assert torch.equal(logits(original_model(tmp_path / "dcp")), expected)


def test_dtypes_change_only_when_asked(hybrid_checkpoint, tmp_path):
    hf = tmp_path / "hf"
    assert main(["to-hf", str(hybrid_checkpoint), str(hf), "--dtype", "bf16"]) == 0
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
    original = {k[len("model."):]: v for k, v in model_part(all_tensors(hybrid_checkpoint)).items()}
    exported = {k[len("model."):] if k.startswith("model.") else k: v for k, v in read_folder(hf).items()}
    assert_same_tensors(exported, {k: v.to(torch.bfloat16) for k, v in original.items()})
    assert main(["from-hf", str(hf), str(tmp_path / "kept")]) == 0
    assert all(v.dtype == torch.bfloat16 for v in model_part(all_tensors(tmp_path / "kept")).values())
    assert main(["from-hf", str(hf), str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    widened = {k[len("model."):]: v for k, v in model_part(all_tensors(tmp_path / "fp32")).items()}
    assert_same_tensors(widened, {k: v.to(torch.bfloat16).float() for k, v in original.items()})


def test_a_bare_state_dict_converts_with_the_config_that_describes_it(tmp_path):
    config_file = tmp_path / "tied.yaml"
    config_file.write_text("model:\n  hidden_size: 32\n  n_layers: 2\n  layer_pattern: GA\n"
                           "  gdn_num_heads: 2\n  gdn_head_dim: 8\n  attn_num_heads: 4\n"
                           "  tie_word_embeddings: true\n")
    model = HybridLM(Config.from_yaml(config_file).model)
    state = model.state_dict()
    assert "lm_head.weight" in state   # a module's state dict holds the tied head too
    torch.save(state, tmp_path / "state.pt")
    assert main(["from-torch", str(tmp_path / "state.pt"), str(tmp_path / "dcp"), "--config",
                 str(config_file)]) == 0
    converted = {k[len("model."):]: v for k, v in model_part(all_tensors(tmp_path / "dcp")).items()}
    assert_same_tensors(converted, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert torch.equal(logits(original_model(tmp_path / "dcp")), logits(model.eval()))
