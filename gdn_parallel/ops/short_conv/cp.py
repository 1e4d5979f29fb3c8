"""Causal short convolution on a CP shard: the previous kernel-1 tokens arrive as a halo."""
from __future__ import annotations

import torch

from ...comm.context import CPContext
from ...comm.halo import exchange_halo
from ...comm.p2p import tie
from .local import causal_conv1d


def cp_causal_conv1d(x, weight, bias, activation, cp: CPContext, impl: str = "auto") -> torch.Tensor:
    """`impl` as in causal_conv1d: it selects the local conv that runs on the shard + halo."""
    B, _, D = x.shape
    width = weight.shape[1] - 1
    anchors = tuple(t for t in (weight, bias) if t is not None)
    halo, token = exchange_halo(cp, x, width, *anchors)
    prefix = None
    if halo is not None:  # zeros stand for positions before the document's start
        prefix = torch.cat([x.new_zeros(B, width - halo.shape[1], D), halo], dim=1)
    # One document on the shard: no boundaries (the kernels' plain path is the faster one).
    cu = None if cp.num_local_docs == 1 else cp.local_cu_seqlens
    y = causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu, prefix=prefix, impl=impl)
    return tie(y, token)
