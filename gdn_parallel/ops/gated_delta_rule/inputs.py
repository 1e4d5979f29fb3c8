"""The argument checks of the delta-rule ops: the gated delta rule's (one log decay per value head and
token) and Kimi Delta Attention's (ops/kda: one per key channel too) take the same q, k, v, beta,
states and documents, so one set of checks serves both; each op adds its own implementations."""
from __future__ import annotations

import torch

from ...config import MAX_HEAD_DIM
from ..validation import check_cu_seqlens, values_checked


def check_rule_inputs(q, k, v, g, beta, initial_state, *, decay_per_channel: bool, g_is_decay: bool,
                      decay_meaning: str) -> tuple[int, int, int, int, int, int]:
    """Shapes, dtypes and ranges of a delta rule's call; returns (B, T, H, K, HV, V). g is [B, T, HV]
    or, with `decay_per_channel`, [B, T, HV, K]; with `g_is_decay` it must be <= 0 (`decay_meaning`
    says why, in the message)."""
    g_rank = 4 if decay_per_channel else 3
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, g_rank), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            hint = (" (KDA's log decay has one value per key channel: [B, T, HV, K])"
                    if name == "g" and decay_per_channel else "")
            raise ValueError(f"{name} must be a {rank}-D tensor, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}{hint}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; they must match")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v has shape {tuple(v.shape)}; its batch and length must match q {tuple(q.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"v has {HV} heads, not a multiple of the {H} heads of q/k (num_v_heads must be "
                         f"a multiple of num_heads)")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM}: q/k have K={K}, v has V={V}")
    g_shape = (B, T, HV, K) if decay_per_channel else (B, T, HV)
    if tuple(g.shape) != g_shape:
        dims, note = (("[B, T, HV, K]", " (a log decay per value head and key channel)") if decay_per_channel
                      else ("[B, T, HV]", ""))
        raise ValueError(f"g must have shape {dims} = {list(g_shape)}{note}, got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must have shape [B, T, HV] = {[B, T, HV]}, got {list(beta.shape)}")
    if g_is_decay and values_checked(g) and g.numel() and bool((g > 0).any()):
        raise ValueError(f"g is the log decay and must be <= 0 everywhere ({decay_meaning}); "
                         f"got max {g.max().item():.4g}")
    if initial_state is not None:
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, K, V):
            raise ValueError(f"initial_state must have shape [N, HV, K, V] = [N, {HV}, {K}, {V}], got "
                             f"{list(initial_state.shape)}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
    return B, T, H, K, HV, V


def check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")


def check_sequences(cu_seqlens, initial_state, batch: int, tokens: int):
    """cu_seqlens checked, and one initial state per sequence (batch row or document)."""
    cu_seqlens = check_cu_seqlens(cu_seqlens, batch, tokens)
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape[0] != num_seqs:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states but there are {num_seqs} "
                         f"sequences ({'documents in cu_seqlens' if cu_seqlens is not None else 'batch'}); "
                         f"give one state per sequence")
    return cu_seqlens


def state_dtype(v: torch.Tensor) -> torch.dtype:
    """The dtype states are kept in: fp32 at least (float64 stays float64)."""
    return torch.promote_types(v.dtype, torch.float32)
