"""Checkpoints of tiny models, each made once per session by our trainer (one step, so the optimizer
slots are real), and helpers to read what a conversion wrote."""
import json
from pathlib import Path

import pytest
import torch

from gdn_parallel.convert.__main__ import main as convert
from gdn_parallel.convert.dcp_io import read_tensors, resolve_checkpoint, tensor_entries
from gdn_parallel.convert.hf_format import EMBEDDED
from gdn_parallel.convert.safetensors_io import read_folder
from gdn_parallel.train.__main__ import run

TRAIN = ["--steps", "1", "--set", "train.seq_len=32", "--set", "train.batch_size=1", "--set",
         "train.eval_rows=2", "--set", "train.warmup_steps=0", "--set", "train.log_every=1", "--set",
         "model.hidden_size=32", "--set", "model.gdn_head_dim=8"]
# G, S and A layers: grouped KV heads, q/k/v biases, tied embeddings
HYBRID = {"model.n_layers": 3, "model.layer_pattern": "GSA", "model.attn_num_heads": 4,
          "model.attn_num_kv_heads": 2, "model.window_size": 8, "model.attn_qkv_bias": True,
          "model.tie_word_embeddings": True}
# pure GDN for flash-linear-attention: grouped value heads, negative eigenvalues, its own lm_head
PURE_GDN = {"model.n_layers": 2, "model.layer_pattern": "G", "model.gdn_num_heads": 1,
            "model.gdn_num_v_heads": 2, "model.gdn_expand_v": 1.0, "model.gdn_allow_neg_eigval": True}

# Kimi Delta Attention for flash-linear-attention's KDAForCausalLM: 2 heads of 32 at hidden 64, weights
# drawn wider than the default init so that the KDA layers move the logits well past the comparisons'
# tolerance. Pure: negative eigenvalues (grouped value heads: test_fla_kda.py's fla-written folder).
# Hybrid: K, S and A layers with grouped KV heads, q/k/v biases and tied embeddings (fla's Attention
# rotates whole heads: RoPE on all of them).
KDA_SHARED = {"model.hidden_size": 64, "model.kda_num_heads": 2, "model.kda_head_dim": 32,
              "model.initializer_range": 0.1}
PURE_KDA = {**KDA_SHARED, "model.n_layers": 2, "model.layer_pattern": "K", "model.kda_allow_neg_eigval": True}
KDA_HYBRID = {**KDA_SHARED, "model.n_layers": 3, "model.layer_pattern": "KSA", "model.attn_num_heads": 2,
              "model.attn_num_kv_heads": 1, "model.window_size": 8, "model.attn_qkv_bias": True,
              "model.tie_word_embeddings": True}


def train_checkpoint(out_dir: Path, settings: dict) -> Path:
    overrides = [x for key, value in settings.items() for x in ("--set", f"{key}={value}")]
    run(TRAIN + overrides + ["--set", f"train.out_dir={out_dir}"])
    return out_dir / "checkpoints" / "step_1"


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory) -> Path:
    return train_checkpoint(tmp_path_factory.mktemp("hybrid-run"), HYBRID)


@pytest.fixture(scope="session")
def gdn_checkpoint(tmp_path_factory) -> Path:
    return train_checkpoint(tmp_path_factory.mktemp("gdn-run"), PURE_GDN)


@pytest.fixture(scope="session")
def kda_checkpoint(tmp_path_factory) -> Path:
    return train_checkpoint(tmp_path_factory.mktemp("kda-run"), PURE_KDA)


@pytest.fixture(scope="session")
def kda_hybrid_checkpoint(tmp_path_factory) -> Path:
    return train_checkpoint(tmp_path_factory.mktemp("kda-hybrid-run"), KDA_HYBRID)


@pytest.fixture(scope="session")
def bpe_checkpoint(tmp_path_factory) -> Path:
    """Pure GDN trained on data prepared with a byte-level BPE tokenizer (tests/tokenized_data.py:
    root/tokenizer.json, root/data); the checkpoint is root/run/checkpoints/step_1."""
    from tests.tokenized_data import prepare_bpe_dataset, texts
    root = tmp_path_factory.mktemp("bpe")
    data = prepare_bpe_dataset(root, texts())
    return train_checkpoint(root / "run", {**PURE_GDN, "model.vocab_size": 300, "data.source": data})


def all_tensors(checkpoint) -> dict:
    """Every tensor of a checkpoint (model and optimizer), by checkpoint key."""
    path = resolve_checkpoint(checkpoint)
    entries = tensor_entries(path)
    return read_tensors(path, entries, list(entries))


def assert_same_tensors(first: dict, second: dict) -> None:
    assert sorted(first) == sorted(second)
    for name, value in first.items():
        assert value.dtype == second[name].dtype and torch.equal(value, second[name]), name


def assert_fla_folder_converts_bit_exactly(fla_model, tmp_path: Path) -> None:
    """fla's save_pretrained of `fla_model` (no config of ours embedded) converts into our checkpoint
    and back to a folder with every tensor bit for bit, and the checkpoint holds fla's weights under
    our names (fla's model is ours under `model.`, lm_head beside it)."""
    fla_model.save_pretrained(tmp_path / "fla")
    assert EMBEDDED not in json.loads((tmp_path / "fla" / "config.json").read_text())
    assert convert(["from-hf", str(tmp_path / "fla"), str(tmp_path / "dcp")]) == 0
    assert convert(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    expected = {k: v.detach() for k, v in fla_model.state_dict().items()}
    assert_same_tensors(read_folder(tmp_path / "back"), expected)
    model = {k[len("model."):]: v for k, v in all_tensors(tmp_path / "dcp").items() if k.startswith("model.")}
    assert_same_tensors({("model." + k if k != "lm_head.weight" else k): v for k, v in model.items()},
                        expected)


def greedy_continuation(model, prompt: torch.Tensor, new_tokens: int, eos: int):
    """Our model's greedy continuation of `prompt` ([1, T] ids): it has no generate, so each step runs
    the whole sequence and takes the argmax of the last logits, up to `new_tokens` or eos. Returns the
    new ids and the smallest top-2 logit margin met (how near a tie the choices came)."""
    ids, margins = prompt, []
    with torch.no_grad():
        for _ in range(new_tokens):
            top = model(ids).logits[0, -1].float().topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
            if int(top.indices[0]) == eos:
                break
    return ids[0, prompt.shape[1]:].tolist(), min(margins)


def skip_unless_fla_generate_works():
    """transformers 5.24 passes the generation cache to the model as `cache`; flash-linear-attention
    0.6.0's forward takes `past_key_values` only, so each new token runs without the recurrent state
    (wrong tokens, no error). setup.py's [dev] asks for transformers < 5.24."""
    import transformers
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 24):
        pytest.skip(f"transformers {transformers.__version__} hands fla 0.6.0 its cache under a name fla "
                    f"ignores; pip install -e '.[dev]' installs transformers < 5.24", allow_module_level=True)
