"""What every token-mixing layer needs to know about the token row besides its values."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SequenceInfo:
    """Document boundaries and positions of the row a model sees.

    cu_seqlens: [N + 1] boundaries of the packed documents (None: each batch row is one sequence).
    position_ids: [B, T] position of each token inside its document (for RoPE).
    cp: the context-parallel plan of this row when it is one shard of a longer sequence (set by
        gdn_parallel.parallel; None on one device). Ops read it; layers only pass it on.
    """
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cp: Any = None
