"""The architecture of a model config: the resolved settings that decide its weights and what the model
computes with them. Two configs with the same architecture hold the same weights, so a checkpoint of
one loads into the other (resume, conversions): the implementations, chunk size and init are free.
"""
from __future__ import annotations

from ..config import ModelConfig
from .mixers import mixer_kinds


def architecture(model: ModelConfig) -> dict[str, object]:
    """Resolved (a null that means 'derived' compares equal to the value it derives), keyed by readable
    field names: the model-wide settings, then each present mixer's (MixerKind.architecture)."""
    arch: dict[str, object] = {
        "model.vocab_size": model.vocab_size, "model.hidden_size": model.hidden_size,
        "model.n_layers": model.n_layers, "layer types (model.layer_pattern)": model.layer_types,
        "MLP width (model.intermediate_size / hidden_ratio)": model.mlp_dim,
        "model.norm_eps": model.norm_eps, "model.tie_word_embeddings": model.tie_word_embeddings}
    for kind in mixer_kinds(model):
        arch.update(kind.architecture(model))
    return arch


def architecture_differences(first: ModelConfig, second: ModelConfig) -> dict[str, tuple]:
    """key -> (first's value, second's) for every setting of either that differs (None: it has none)."""
    a, b = architecture(first), architecture(second)
    return {key: (a.get(key), b.get(key)) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)}
