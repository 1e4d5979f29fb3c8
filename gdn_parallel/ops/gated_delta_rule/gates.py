"""The decay and beta activations of a Gated DeltaNet layer, for the paths that do not fuse them
(naive, chunk, the PyTorch CP path); the Triton kernels compute the same in their first launch
(gdn_kernels.gated_delta_rule.gates)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

BETA_ACTIVATIONS = (None, "sigmoid", "2sigmoid")


def activate_gates(g: torch.Tensor, beta: torch.Tensor, decay_params, beta_activation):
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32 (at least) if decay_params = (A_log, dt_bias)
    is given (g holds a), else g; beta = sigmoid(beta) or 2 sigmoid(beta) (negative eigenvalues)."""
    if decay_params is not None:
        A_log, dt_bias = decay_params
        dtype = torch.promote_types(g.dtype, torch.float32)
        g = -A_log.to(dtype).exp() * F.softplus(g.to(dtype) + dt_bias.to(dtype))
    if beta_activation is not None:
        beta = beta.sigmoid() * 2.0 if beta_activation == "2sigmoid" else beta.sigmoid()
    return g, beta


def check_gate_args(decay_params, beta_activation, num_v_heads: int):
    if beta_activation not in BETA_ACTIVATIONS:
        raise ValueError(f"beta_activation={beta_activation!r} is not one of {BETA_ACTIVATIONS}")
    if decay_params is None:
        return
    if not isinstance(decay_params, (tuple, list)) or len(decay_params) != 2:
        raise ValueError("decay_params must be the pair (A_log, dt_bias) of [HV] tensors")
    for name, p in zip(("A_log", "dt_bias"), decay_params):
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != (num_v_heads,) or not p.is_floating_point():
            raise ValueError(f"decay_params: {name} must be a float tensor of shape [HV] = [{num_v_heads}], "
                             f"got {tuple(getattr(p, 'shape', ())) or type(p).__name__}")
