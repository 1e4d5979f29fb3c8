"""What every token-mixing layer needs to know about the token row besides its values."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SequenceInfo:
    """Document boundaries and positions of the row a model sees.

    cu_seqlens: [N + 1] boundaries of the packed documents (None: each batch row is one sequence).
    position_ids: [B, T] position of each token inside its document (for RoPE).
    cp: the context-parallel plan of this row when it is one shard of a longer sequence (set by
        gdn_parallel.parallel; None on one device). Ops read it; layers only pass it on.
    memo: what ops derive from the row alone, built by the first layer that needs it and kept for
        the others and for their recomputation (the attention layers' document ids and block masks:
        dozens of small kernels each, per layer, otherwise). Lives as long as this object: one row.
    """
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cp: Any = None
    memo: dict = field(default_factory=dict, repr=False, compare=False)
