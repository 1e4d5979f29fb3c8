"""The loss as a module, so that parallelism can swap it (vocab-parallel cross-entropy) from outside.

A criterion with `fuses_lm_head = True` is called as criterion(hidden, lm_head.weight, labels) and
applies lm_head itself; otherwise as criterion(logits, labels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import IGNORE_INDEX
from ..ops.cross_entropy import linear_cross_entropy


def lm_head_loss(criterion: nn.Module, lm_head: nn.Module, hidden: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
    """criterion's summed loss of lm_head over hidden; the one place that knows both call forms
    (HybridLM and the last pipeline stage share it)."""
    if getattr(criterion, "fuses_lm_head", False):  # applies lm_head chunk by chunk itself
        return criterion(hidden, lm_head.weight, labels)
    return criterion(lm_head(hidden), labels)


class TokenCrossEntropy(nn.Module):
    """Summed cross-entropy over the tokens whose label is not IGNORE_INDEX (fp32 for half inputs)."""

    fuses_lm_head = False

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")


class LinearCrossEntropy(nn.Module):
    """TokenCrossEntropy()(hidden @ weight.T, labels), computed a chunk of tokens at a time
    (ops.cross_entropy) so the [tokens, vocab] logits never exist at once."""

    fuses_lm_head = True

    def __init__(self, chunk_tokens: int | None = None):
        super().__init__()
        self.chunk_tokens = chunk_tokens  # None: the kernel picks one from the vocabulary size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, chunk_tokens=self.chunk_tokens)
