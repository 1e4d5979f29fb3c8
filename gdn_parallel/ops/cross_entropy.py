"""Linear + cross-entropy without the [tokens, vocab] logits (the fused kernel of
gdn_kernels.linear_cross_entropy, which runs in torch chunks without Triton too), and its oracle.

Both sum the cross-entropy over the tokens whose label is not IGNORE_INDEX. Under vocabulary
parallelism `weight` is this rank's rows from `vocab_start` on and `group` the tensor-parallel group
(see the kernel's docstring)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import IGNORE_INDEX
from .triton_dispatch import imported_kernel

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         vocab_start: int = 0, group=None, chunk_tokens: int | None = None) -> torch.Tensor:
    return imported_kernel("linear_cross_entropy").linear_cross_entropy(
        hidden, weight, labels, ignore_index=IGNORE_INDEX, vocab_start=vocab_start, group=group,
        chunk_tokens=chunk_tokens)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor,
                                   labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
