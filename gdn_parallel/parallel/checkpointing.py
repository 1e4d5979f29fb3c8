"""Activation checkpointing, applied from outside the model like the parallel dimensions.

"full": each block keeps only its input; its activations are recomputed in the backward. Memory per
token drops from every activation of every layer to one hidden vector per layer, for about one extra
forward. Blocks are wrapped in place (their `forward`), so parameter names and the hooks that tensor,
pipeline and data parallelism put on modules stay as they are.

"selective": only each block's MLP branch (the SwiGLU) is recomputed: it keeps the branch's input, the
norm's bf16 output, instead of the MLP's activations (the gate and up projections, the widest tensors
of a block), for about a third of a forward's matrix work more. The token mixer keeps
its activations, so nothing that communicates under context parallelism runs twice.

Under context parallelism a recomputed block does not communicate again: what it received in its
first forward (states, halos, all-gathered summaries) is replayed from a log and its sends are
skipped (comm/replay.py), so the backward of a layer never waits on another rank's
recomputation. Recomputation runs the whole block (no early stop), so that the log is read through
in the order it was written.

With an `offload` (parallel/offload.py, "full" only), the inputs the first `offload_blocks` blocks
keep are held in host memory between their forward and their recomputation.

With `chunks` > 1 ("full" only) each block runs over the row in that many sequence chunks, each a
checkpoint of its own: the backward recomputes one chunk at a time, so a block's working set shrinks
by the chunk count while what is kept stays the block's input. The chunks are context-parallel ranks
run in turn by one process (comm/context.py, `Loopback`): a GDN layer's state and the conv and
sliding-window halos go from chunk to chunk as they go from rank to rank, as tensors in autograd,
and under context parallelism the first and last chunk of a rank talk to the neighbouring ranks.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..comm.context import CPContext, Loopback
from ..comm.replay import ReplayLog
from ..config import CHECKPOINTING_MODES
from ..model import SequenceInfo, blocks_of
from ..model.mixers import check_context_parallel
from ..ops.rope import positions_from_cu_seqlens
from .offload import BlockInputOffload, offload_context


def apply_activation_checkpointing(model: nn.Module, mode: str, offload: BlockInputOffload | None = None,
                                   offload_blocks: int = 0, chunks: int = 1) -> int:
    """Wrap every block of `model.layers` (a HybridLM or a pipeline stage); returns how many.
    `offload`: the inputs of the first `offload_blocks` blocks this process holds (0: all) are kept
    in host memory; `chunks`: each block recomputed in that many sequence chunks (mode "full" only)."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {CHECKPOINTING_MODES}")
    if offload is not None and mode != "full":
        raise ValueError(f"activation offload holds the inputs full checkpointing keeps; "
                         f"activation_checkpointing={mode!r} keeps other tensors: use 'full'")
    if chunks > 1 and mode != "full":
        raise ValueError(f"recomputing blocks in {chunks} chunks needs activation_checkpointing='full', "
                         f"got {mode!r}")
    if mode == "none":
        return 0
    if getattr(model, "layers", None) is None:
        raise ValueError("activation checkpointing wraps model.layers; this module has none")
    blocks = blocks_of(model)
    # the layers this process holds, as their kinds declare (MixerKind.context_parallel); a ConfigError
    # is a ValueError
    check_context_parallel([block.symbol for block in blocks], recompute_chunks=chunks)
    count = 0
    offloaded = len(blocks) if offload_blocks <= 0 else offload_blocks
    for index, block in enumerate(blocks):
        if getattr(block, "_checkpointed", False):
            continue
        if mode == "full":
            held = offload if index < offloaded else None
            if chunks > 1:
                block.forward = functools.partial(_chunked_forward, block.forward, held, chunks)
            else:
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


def _chunked_forward(forward, offload, chunks: int, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return forward(x, seq)
    pieces = _chunk_sequences(seq, x, chunks)
    length = x.shape[1] // chunks
    outputs = [_checkpointed_forward(forward, offload, x[:, k * length:(k + 1) * length], piece)
               for k, piece in enumerate(pieces)]
    return torch.cat(outputs, dim=1)


def _chunk_sequences(seq: SequenceInfo, x: torch.Tensor, chunks: int) -> list[SequenceInfo]:
    """The SequenceInfo of each chunk of the row: a context-parallel plan whose ranks are the chunks
    (inside this process's shard, under context parallelism). Made once per row (seq.memo): the
    chunks of every block share it, their hand-overs being consumed block by block."""
    key = ("recompute chunks", chunks)
    if key in seq.memo:
        return seq.memo[key]
    batch, total = x.shape[:2]
    if batch != 1:
        raise ValueError(f"train.recompute_chunks={chunks} splits one packed row (batch 1); got {batch} rows")
    if total % chunks:
        raise ValueError(f"a row of {total} tokens does not split into train.recompute_chunks={chunks} "
                         f"chunks")
    base, loopback, length = seq.cp, Loopback(), total // chunks
    positions = seq.position_ids
    if base is None:
        cu = [0, total] if seq.cu_seqlens is None else [int(c) for c in seq.cu_seqlens.tolist()]
        if positions is None:
            positions = positions_from_cu_seqlens(torch.tensor(cu), total, x.device).unsqueeze(0)
        plans = [CPContext(None, k, chunks, cu, length, "relay", x.device, chunks=chunks, loopback=loopback)
                 for k in range(chunks)]
    else:
        plans = [CPContext(base.group, base.rank * chunks + k, base.size * chunks, base.global_cu, length,
                           base.algorithm, base.device, outbox=base.outbox, chunks=chunks, loopback=loopback)
                 for k in range(chunks)]
    pieces = [SequenceInfo(cu_seqlens=None, cp=plan, position_ids=None if positions is None
                           else positions[:, k * length:(k + 1) * length])
              for k, plan in enumerate(plans)]
    seq.memo[key] = pieces
    return pieces
