"""Halo exchange: the last tokens of the same document from the previous rank(s).

Rank r needs the `width` tokens before its shard that belong to the document it starts in
(fewer at a document start). When a shard is shorter than the halo, the previous rank forwards its
own received halo with its tokens (multi-hop). Gradients of the halo flow back the same way.
"""
from __future__ import annotations

import torch

from .context import CPContext
from .p2p import post_recv_from_prev, send_to_next


def exchange_halo(cp: CPContext, x: torch.Tensor, width: int, *anchors: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x: [B, L, ...] local tokens. Returns (halo [B, h, ...] or None, token for `p2p.tie`)."""
    L = x.shape[1]
    h_in = cp.halo_len(width)
    h_out = cp.halo_len(width, cp.rank + 1) if cp.rank + 1 < cp.size else 0
    incoming = (post_recv_from_prev(cp, (x.shape[0], h_in, *x.shape[2:]), x.dtype, x.device)
                if h_in else None)
    token = None
    if 0 < h_out <= L:  # the next rank's halo is all local: send before waiting on our own
        token = send_to_next(cp, x[:, L - h_out:])
    halo = incoming.wait(x, *anchors) if incoming is not None else None
    if h_out > L:       # multi-hop: forward part of what we received
        if halo is None:
            raise RuntimeError(f"CP rank {cp.rank} forwards {h_out - L} received halo tokens to rank "
                               f"{cp.rank + 1} but received none")
        token = send_to_next(cp, torch.cat([halo, x], dim=1)[:, -h_out:])
    return halo, token
