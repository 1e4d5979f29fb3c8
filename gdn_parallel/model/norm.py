"""RMSNorm and the gated RMSNorm (swish gate) that closes a Gated DeltaNet layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.triton_dispatch import auto_uses_triton, imported_kernel


class RMSNorm(nn.Module):
    """Under autocast the output comes in the autocast dtype: it feeds matrix products only, which
    would cast it anyway, and once per consumer (six projections in a GDN layer), each cast copy
    saved for the backward. The residual stream it reads keeps its own dtype (model.residual_in_fp32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype=narrower_autocast_dtype(x))


class ResidualRMSNorm(RMSNorm):
    """A block's norm on the residual stream: forward(x, branch=None) -> (h, rmsnorm(h)) with
    h = x + branch (the branch a layer's output, in the autocast dtype) or x itself. Same parameters
    and output as RMSNorm; on CUDA the sum, the norm and, in the backward, the stream's gradient
    meeting the norm's, each run in one kernel pass (gdn_kernels.norms.triton_residual_rms_norm)."""

    def forward(self, x: torch.Tensor, branch: torch.Tensor | None = None):  # type: ignore[override]
        return residual_rms_norm(x, branch, self.weight, self.eps, out_dtype=narrower_autocast_dtype(x))


class GatedRMSNorm(RMSNorm):
    """rmsnorm(x) * weight * silu(gate): normalise first, then gate (flash-linear-attention's order).
    activation="sigmoid": * sigmoid(gate) instead (Kimi Delta Attention's output gate; fla's
    FusedRMSNormGated(activation="sigmoid")), the gate applied after the norm's kernel."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__(dim, eps)
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation={activation!r}: the gated RMSNorm takes 'silu' or 'sigmoid'")
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if self.activation == "sigmoid" and gate is not None:
            out = rms_norm(x, self.weight, self.eps)
            return out * torch.sigmoid(gate.to(out.dtype))
        return rms_norm(x, self.weight, self.eps, gate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight [* silu(gate)] over the last dim, in fp32 for half inputs;
    the result in out_dtype (default x's dtype).

    On CUDA the fused Triton kernel serves (x read once, forward and backward); elsewhere, or where
    it does not apply, the PyTorch formula below."""
    if _fused_applies(x, gate):
        return imported_kernel("norms").triton_rms_norm(x, weight, eps, gate, out_dtype)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * weight.to(normed.dtype)).to(out_dtype or x.dtype)
    return out if gate is None else out * F.silu(gate.to(out.dtype))


def residual_rms_norm(x: torch.Tensor, branch: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h, weight)) with h = x + branch in x's dtype, or h = x: the fused kernel on CUDA,
    elsewhere the formula (which autograd differentiates)."""
    if _fused_applies(x, None) and (branch is None or branch.shape == x.shape):
        return imported_kernel("norms").triton_residual_rms_norm(x, branch, weight, eps, out_dtype)
    h = x if branch is None else (x + branch).to(x.dtype)
    return h, rms_norm(h, weight, eps, out_dtype=out_dtype)


def narrower_autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype for x's device when autocast is on there and x is wider, else None."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if x.dtype.itemsize > dtype.itemsize else None


def _fused_applies(x: torch.Tensor, gate: torch.Tensor | None) -> bool:
    # the kernel holds a row in registers and reads the gate element for element (no broadcasting)
    return (auto_uses_triton(x, "norms") and x.shape[-1] <= imported_kernel("norms").MAX_HIDDEN
            and (gate is None or gate.shape == x.shape))
