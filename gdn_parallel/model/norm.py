"""RMSNorm and the gated RMSNorm (swish gate) that closes a Gated DeltaNet layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(normed.dtype)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """rmsnorm(x) * weight * silu(gate): normalise first, then gate (flash-linear-attention's order)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor = None) -> torch.Tensor:
        out = super().forward(x)
        return out if gate is None else out * F.silu(gate.to(out.dtype))
