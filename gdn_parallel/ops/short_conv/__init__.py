"""Causal depthwise short convolution (the kernel-4 conv in front of q, k, v of a GDN layer): the
public op. The single-device forms and the oracle are in local.py, the context-parallel form in cp.py.

    y[t] = act(bias + sum_{i=0..W-1} weight[:, i] * x[t - (W-1) + i])
"""
from __future__ import annotations

import torch

from ...comm import CPContext
from .cp import cp_causal_conv1d
from .local import causal_conv1d as local_causal_conv1d
from .local import causal_conv1d_naive, check_conv_args, resolve_impl

__all__ = ["causal_conv1d", "causal_conv1d_naive"]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None,
                  prefix: torch.Tensor | None = None, impl: str = "auto",
                  cp: CPContext | None = None) -> torch.Tensor:
    """x [B, T, D], weight [D, W] -> y [B, T, D] in x's dtype (local.causal_conv1d: documents, prefix, impl).

    With `cp` (the row's context-parallel plan; give no `cu_seqlens` and no `prefix`) x is this rank's
    shard of one packed row, and the previous W-1 tokens of the same document arrive from the previous
    rank(s) as a halo (docs/design.md §2).
    """
    if cp is None:
        return local_causal_conv1d(x, weight, bias, activation, cu_seqlens, prefix, impl)
    check_conv_args(x, weight, bias, activation, None, prefix)
    resolve_impl(impl, x)  # fail early, before the halo exchange; the local conv resolves it again
    if prefix is not None or cu_seqlens is not None:
        raise ValueError("prefix and cu_seqlens exclude cp: under context parallelism the prefix is the halo "
                         "received from the previous rank and the plan holds the global boundaries")
    if x.shape[0] != 1:
        raise ValueError(f"context parallelism takes one packed row: x has batch {x.shape[0]}")
    if x.shape[1] != cp.local_len:
        raise ValueError(f"x has {x.shape[1]} tokens but the CP plan has {cp.local_len} per rank")
    return cp_causal_conv1d(x, weight, bias, activation, cp, impl=impl)
