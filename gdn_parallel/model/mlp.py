"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

from torch import nn

from ..ops.projections import project
from ..ops.swiglu import swiglu_down


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        # the down projection's input is recomputed in the backward rather than saved (ops/swiglu.py)
        return swiglu_down(*project(x, self.gate_proj, self.up_proj), self.down_proj.weight)
