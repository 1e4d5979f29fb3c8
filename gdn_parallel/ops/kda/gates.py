"""The decay and beta activations of a Kimi Delta Attention layer (Kimi Linear's), applied in PyTorch
before the op's chunk form (no kernel fuses them yet):

    g = -exp(A_log) * softplus(f + dt_bias)    per value head and key channel, <= 0
    beta = sigmoid(b), or 2 sigmoid(b) when the transition may have negative eigenvalues

with A_log [HV] (one rate per value head) and dt_bias [HV * K] (one time-step bias per channel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gated_delta_rule.gates import BETA_ACTIVATIONS


def activate_kda_gates(g: torch.Tensor, beta: torch.Tensor, decay_params, beta_activation):
    """g [B, T, HV, K]: the logits f when decay_params = (A_log, dt_bias) is given (the log decay in fp32,
    at least, comes back), else the log decay itself; beta [B, T, HV]: logits when beta_activation is
    "sigmoid" or "2sigmoid", else beta itself."""
    if decay_params is not None:
        A_log, dt_bias = decay_params
        HV, K = g.shape[-2:]
        dtype = torch.promote_types(g.dtype, torch.float32)
        rate = A_log.to(dtype).exp()[:, None]
        g = -rate * F.softplus(g.to(dtype) + dt_bias.to(dtype).view(HV, K))
    if beta_activation is not None:
        beta = beta.sigmoid() * 2.0 if beta_activation == "2sigmoid" else beta.sigmoid()
    return g, beta


def check_kda_gate_args(decay_params, beta_activation, num_v_heads: int, head_k_dim: int) -> None:
    if beta_activation not in BETA_ACTIVATIONS:
        raise ValueError(f"beta_activation={beta_activation!r} is not one of {BETA_ACTIVATIONS}")
    if decay_params is None:
        return
    if not isinstance(decay_params, (tuple, list)) or len(decay_params) != 2:
        raise ValueError("decay_params must be the pair (A_log [HV], dt_bias [HV * K]) of tensors")
    for name, p, size in zip(("A_log", "dt_bias"), decay_params, (num_v_heads, num_v_heads * head_k_dim)):
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != (size,) or not p.is_floating_point():
            expected = "[HV]" if name == "A_log" else "[HV * K]"
            raise ValueError(f"decay_params: {name} must be a float tensor of shape {expected} = [{size}], "
                             f"got {tuple(getattr(p, 'shape', ())) or type(p).__name__}")
