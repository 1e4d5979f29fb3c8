"""Activation checkpointing recomputes each block in the backward and changes nothing else."""
import copy

import pytest
import torch

from gdn_parallel.config import ConfigError, TrainConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing
from tests.parallel.batches import make_batch
from tests.parallel.test_layouts import model_config


def test_blocks_are_recomputed_and_gradients_are_unchanged():
    torch.manual_seed(0)
    plain = HybridLM(model_config()).double()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, "full") == len(wrapped.layers)
    calls = []
    for block in wrapped.layers:
        block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = make_batch([0, 5, 19, 20, 40, 48], seed=3)
    losses = []
    for model in (plain, wrapped):
        out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()
        losses.append(out.loss.item())
    assert len(calls) == 2 * len(wrapped.layers)          # forward + recompute
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]


def test_no_recompute_without_grad_and_bad_mode_is_named():
    model = HybridLM(model_config()).double()
    apply_activation_checkpointing(model, "full")
    with torch.no_grad():
        model(make_batch([0, 48], seed=1).input_ids)
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        apply_activation_checkpointing(model, "some")
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        TrainConfig(activation_checkpointing="blocks").validate()
