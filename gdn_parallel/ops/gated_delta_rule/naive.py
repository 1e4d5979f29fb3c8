"""The oracle: the gated delta rule one token at a time, exactly as written in docs/design.md §1.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

Inputs are already validated and expanded (q/k repeated to the value heads); documents are split
by the caller. Computes in the promoted dtype of the inputs (tests use float64).
"""
from __future__ import annotations

import torch


def naive_recurrence(q, k, v, g, beta, scale: float, initial_state: torch.Tensor | None):
    """q, k: [B, T, HV, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; state [B, HV, K, V].

    Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] in the compute dtype).
    """
    dtype = torch.promote_types(v.dtype, torch.float32)
    B, T, HV, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = (q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dtype))
    outputs = []
    for t in range(T):
        k_t, v_t, q_t = k[:, t], v[:, t], q[:, t]
        state = state * g[:, t].exp()[..., None, None]
        # Delta rule: replace the value currently stored under k_t by v_t, at rate beta_t.
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - predicted) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q_t) * scale)
    o = torch.stack(outputs, dim=1) if T else v.new_zeros(B, 0, HV, V)
    return o.to(v.dtype), state
