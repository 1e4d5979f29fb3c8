"""Building a HybridLM part by part, so that a process materialises only the parts it trains.

The model's skeleton is made on the meta device (no memory); then each kept part (`embeddings`,
`layers.<i>`, `norm`, `lm_head`) is built on the target device from its own random generator,
seeded by (seed, part name). A part therefore gets the same values whichever other parts a process
builds: a pipeline rank that keeps layers 12-23 holds exactly the weights a single device would
have there, and never the others. The parts not kept are dropped: `layers.<i>` becomes a
`DroppedPart` (parameter names of the kept layers do not move), the others None.

The values are those of `HybridLM(config)` in distribution (the same initialisers), not in draws:
that one draws every part from the global generator in turn.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from ..config import ModelConfig
from .hybrid_lm import Block, DroppedPart, HybridLM, init_linear_weights
from .norm import RMSNorm


def part_names(config: ModelConfig) -> list[str]:
    return ["embeddings", *(f"layers.{i}" for i in range(config.n_layers)), "norm", "lm_head"]


def part_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def _make_part(name: str, config: ModelConfig) -> nn.Module:
    part: nn.Module
    if name == "embeddings":
        part = nn.Embedding(config.vocab_size, config.hidden_size)
    elif name == "norm":
        return RMSNorm(config.hidden_size, config.norm_eps)
    elif name == "lm_head":
        part = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    else:
        index = int(name.split(".")[1])
        part = Block(config.layer_types[index], config)
    init_linear_weights(part, config)
    return part


def build_model(config: ModelConfig, device, seed: int,
                keep: Callable[[str], bool] | None = None) -> HybridLM:
    """A HybridLM on `device` with the parts for which keep(name) is true (all by default); see the
    module docstring. Tied embeddings: lm_head is the embedding's weight, built wherever either is kept."""
    keep = keep or (lambda name: True)
    device = torch.device(device)
    with torch.device("meta"):
        model = HybridLM(config)
    tied = config.tie_word_embeddings
    wanted = {name: keep(name) for name in part_names(config)}
    if tied:
        wanted["embeddings"] = wanted["embeddings"] or wanted["lm_head"]
    devices = [device] if device.type == "cuda" else []
    for name, kept in wanted.items():  # embeddings come before lm_head
        part: nn.Module | None = None
        if kept and name == "lm_head" and tied:  # the embedding's weight: nothing to draw
            part = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
            part.weight = model.embeddings.weight
        elif kept:
            with torch.random.fork_rng(devices=devices), torch.device(device):
                torch.manual_seed(part_seed(seed, name))
                part = _make_part(name, config)
        if name.startswith("layers."):
            model.layers[int(name.split(".")[1])] = DroppedPart() if part is None else part
        else:
            setattr(model, name, part)
    return model
