"""Checkpoints of tiny models, each made once per session by our trainer (one step, so the optimizer
slots are real), and helpers to read what a conversion wrote."""
from pathlib import Path

import pytest
import torch

from gdn_parallel.convert.dcp_io import read_tensors, resolve_checkpoint, tensor_entries
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


def all_tensors(checkpoint) -> dict:
    """Every tensor of a checkpoint (model and optimizer), by checkpoint key."""
    path = resolve_checkpoint(checkpoint)
    entries = tensor_entries(path)
    return read_tensors(path, entries, list(entries))


def assert_same_tensors(first: dict, second: dict) -> None:
    assert sorted(first) == sorted(second)
    for name, value in first.items():
        assert value.dtype == second[name].dtype and torch.equal(value, second[name]), name
