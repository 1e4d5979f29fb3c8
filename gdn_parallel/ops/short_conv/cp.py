"""Causal short convolution on a CP shard: the previous kernel-1 tokens arrive as a halo."""
from __future__ import annotations

import torch

from ...comm.context import CPContext
from ...comm.halo import exchange_halo
from ...comm.p2p import tie
from .local import causal_conv1d


def cp_causal_conv1d(x, weight, bias, activation, cp: CPContext, impl: str = "auto") -> torch.Tensor:
    """`impl` as in causal_conv1d: it selects the local conv that runs on the shard + halo."""
    width = weight.shape[1] - 1
    anchors = tuple(t for t in (weight, bias) if t is not None)
    halo, token = exchange_halo(cp, x, width, *anchors)
    cu, prefix = _local_conv_inputs(cp, x, halo, width)
    y = causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu, prefix=prefix, impl=impl)
    return tie(y, token)


def _local_conv_inputs(cp: CPContext, x: torch.Tensor, halo: torch.Tensor | None, width: int):
    """(cu_seqlens, prefix) for the local conv, of one form on a rank whatever the row's documents: the
    kernels compile a variant for each (boundaries or none, prefix or none), so a form that followed the
    data (one document on the shard, a document starting at the boundary) compiled again at the first
    step that brought it, seconds on a rank while the others waited in the relay (1M tokens, cp 4)."""
    if cp.rank == 0 or width == 0:
        return cp.local_cu_seqlens, None
    B, _, D = x.shape
    halo = x.new_zeros(B, 0, D) if halo is None else halo
    # zeros stand for positions before the document's start
    return cp.local_cu_seqlens, torch.cat([x.new_zeros(B, width - halo.shape[1], D), halo], dim=1)
