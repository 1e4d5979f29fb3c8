"""Activation checkpointing, applied from outside the model like the parallel dimensions.

"full": each block keeps only its input; its activations are recomputed in the backward. Memory per
token drops from every activation of every layer to one hidden vector per layer, for about one extra
forward. Blocks are wrapped in place (their `forward`), so parameter names and the hooks that tensor,
pipeline and data parallelism put on modules stay as they are.

"selective": only each block's MLP branch (its norm and the SwiGLU) is recomputed: it keeps the
branch's input instead of the norm's and the MLP's activations (the gate and up projections, the
widest tensors of a block), for about a third of a forward's matrix work more. The token mixer keeps
its activations, so nothing that communicates under context parallelism runs twice.

Under context parallelism a recomputed block does not communicate again: what it received in its
first forward (states, halos, all-gathered summaries) is replayed from a log and its sends are
skipped (comm/replay.py), so the backward of a layer never waits on another rank's
recomputation. Recomputation runs the whole block (no early stop), so that the log is read through
in the order it was written.

With an `offload` (parallel/offload.py, "full" only), the inputs the first `offload_blocks` blocks
keep are held in host memory between their forward and their recomputation.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..comm.replay import ReplayLog
from ..config import CHECKPOINTING_MODES
from ..model import blocks_of
from .offload import BlockInputOffload, offload_context


def apply_activation_checkpointing(model: nn.Module, mode: str, offload: BlockInputOffload | None = None,
                                   offload_blocks: int = 0) -> int:
    """Wrap every block of `model.layers` (a HybridLM or a pipeline stage); returns how many.
    `offload`: the inputs of the first `offload_blocks` blocks this process holds (0: all) are kept
    in host memory (mode "full" only)."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {CHECKPOINTING_MODES}")
    if offload is not None and mode != "full":
        raise ValueError(f"activation offload holds the inputs full checkpointing keeps; "
                         f"activation_checkpointing={mode!r} keeps other tensors: use 'full'")
    if mode == "none":
        return 0
    if getattr(model, "layers", None) is None:
        raise ValueError("activation checkpointing wraps model.layers; this module has none")
    blocks = blocks_of(model)
    count = 0
    offloaded = len(blocks) if offload_blocks <= 0 else offload_blocks
    for index, block in enumerate(blocks):
        if getattr(block, "_checkpointed", False):
            continue
        if mode == "full":
            held = offload if index < offloaded else None
            block.forward = functools.partial(_checkpointed_forward, block.forward, held)
        else:
            block.mlp_branch = functools.partial(_recomputed, block.mlp_branch)
        block._checkpointed = True
        count += 1
    return count


def _recomputed(branch, *args, **kwargs):
    """A branch that neither receives nor sends anything: plain non-reentrant checkpointing."""
    if not torch.is_grad_enabled():
        return branch(*args, **kwargs)
    return checkpoint(branch, *args, use_reentrant=False, **kwargs)


def _checkpointed_forward(forward, offload, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    log = ReplayLog()
    # the offload hooks see only what the checkpoint itself saves, the block's inputs: inside the
    # call, the checkpoint's own hooks take the block's tensors
    with set_checkpoint_early_stop(False), offload_context(offload):
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=lambda: (log.recording(), log.replaying()), **kwargs)
