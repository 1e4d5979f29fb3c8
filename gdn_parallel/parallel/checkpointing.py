"""Activation checkpointing, applied from outside the model like the parallel dimensions.

"full": each block keeps only its input; its activations are recomputed in the backward. Memory per
token drops from every activation of every layer to one hidden vector per layer, for about one extra
forward. Blocks are wrapped in place (their `forward`), so parameter names and the hooks that tensor,
pipeline and data parallelism put on modules stay as they are.

Under context parallelism a recomputed block re-runs its hand-overs (state relay, conv and window
halos, all-gathers): every rank recomputes the same blocks in the same order, so the re-sent
messages pair up. Recomputation must therefore run the whole block, never stop early (PyTorch's
default early stop would skip the sends after the last saved tensor).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

MODES = ("none", "full")


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Wrap every block of `model.layers` (a HybridLM or a pipeline stage); returns how many."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {MODES}")
    if mode == "none":
        return 0
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("activation checkpointing wraps model.layers; this module has none")
    blocks = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    count = 0
    for block in blocks:
        if not getattr(block, "_checkpointed", False):
            block.forward = functools.partial(_checkpointed_forward, block.forward)
            block._checkpointed = True
            count += 1
    return count


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    with set_checkpoint_early_stop(False):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
