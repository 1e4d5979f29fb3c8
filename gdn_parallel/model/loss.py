"""The loss as a module, so that parallelism can swap it (vocab-parallel cross-entropy) from outside."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class TokenCrossEntropy(nn.Module):
    """Summed cross-entropy over the tokens whose label is not IGNORE_INDEX (fp32 for half inputs)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
