"""Activation checkpointing, applied from outside the model like the parallel dimensions.

"full": each block keeps only its input; its activations are recomputed in the backward. Memory per
token drops from every activation of every layer to one hidden vector per layer, for about one extra
forward. Blocks are wrapped in place (their `forward`), so parameter names and the hooks that tensor,
pipeline and data parallelism put on modules stay as they are.

Under context parallelism a recomputed block does not communicate again: what it received in its
first forward (states, halos, all-gathered summaries) is replayed from a log and its sends are
skipped (parallel/cp/replay.py), so the backward of a layer never waits on another rank's
recomputation. Recomputation runs the whole block (no early stop), so that the log is read through
in the order it was written.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .cp.replay import ReplayLog

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
    log = ReplayLog()
    with set_checkpoint_early_stop(False):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: (log.recording(), log.replaying()),
                          **kwargs)
