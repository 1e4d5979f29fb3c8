"""The oracle: Kimi Delta Attention one token at a time, in float64.

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

The gated delta rule (gated_delta_rule/naive.py) with a decay per key channel: g_t is a vector of K
log decays instead of one per head. The state is [K, V] as there, so both share the CP machinery.
Inputs are already validated and expanded (q/k repeated to the value heads).
"""
from __future__ import annotations

import torch

ORACLE_DTYPE = torch.float64


def naive_recurrence(q, k, v, g, beta, scale: float, initial_state: torch.Tensor | None):
    """q, k, g: [B, T, HV, K]; v: [B, T, HV, V]; beta: [B, T, HV]; state [B, HV, K, V].

    Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] in float64).
    """
    B, T, HV, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(ORACLE_DTYPE) for x in (q, k, v, g, beta))
    state = (q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(ORACLE_DTYPE))
    outputs = []
    for t in range(T):
        k_t, v_t, q_t = k[:, t], v[:, t], q[:, t]
        # Decay first, per key channel (row of the state), then the delta rule on the decayed state.
        state = state * g[:, t].exp()[..., None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - predicted) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q_t) * scale)
    o = torch.stack(outputs, dim=1) if T else v.new_zeros(B, 0, HV, V, dtype=ORACLE_DTYPE)
    return o.to(v.dtype), state


def naive_documents(q, k, v, g, beta, scale: float, initial_state: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None):
    """The oracle over a batch, or over the documents of one packed row (B = 1) when `cu_seqlens`
    [N + 1] is given: each document starts from its own initial state (row i of `initial_state`
    [N, HV, K, V]) or from zero. Returns (o [B, T, HV, V], final states [N, HV, K, V] float64)."""
    if cu_seqlens is None:
        return naive_recurrence(q, k, v, g, beta, scale, initial_state)
    bounds = cu_seqlens.tolist()
    outputs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[i:i + 1]
        o, final = naive_recurrence(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                    beta[:, start:end], scale, h0)
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs, dim=1), torch.cat(finals)
