"""Gated DeltaNet token mixer, with flash-linear-attention's parameter names, shapes and init."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.gated_delta_rule import gated_delta_rule
from ..ops.projections import linear, project
from ..ops.short_conv import causal_conv1d
from .norm import GatedRMSNorm
from .sequence import SequenceInfo


class ShortConvolution(nn.Module):
    """Causal depthwise convolution + SiLU; `weight` is [channels, 1, kernel] like nn.Conv1d."""

    def __init__(self, channels: int, kernel_size: int, bias: bool = False):
        super().__init__()
        bound = 1.0 / math.sqrt(kernel_size)  # nn.Conv1d's default for a depthwise kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(channels).uniform_(-bound, bound)) if bias else None

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        # Under autocast x comes out of the projections in bf16 while the weights stay fp32: the op
        # takes them as they are (no cast per call, a weight gradient in fp32 straight from its sums).
        return causal_conv1d(x, self.weight.squeeze(1), self.bias, activation="silu",
                             cu_seqlens=seq.cu_seqlens, cp=seq.cp)


NO_WEIGHT_DECAY = "_no_weight_decay"  # a parameter flag: no weight decay on it (train/optim.py)


def _mark_no_weight_decay(*params: nn.Parameter) -> None:
    for p in params:
        setattr(p, NO_WEIGHT_DECAY, True)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_v_heads = config.gdn_num_heads, config.num_v_heads
        self.head_k_dim, self.head_v_dim = config.gdn_head_dim, config.head_v_dim
        self.allow_neg_eigval = config.gdn_allow_neg_eigval
        self.chunk_size, self.impl = config.gdn_chunk_size, config.gdn_impl
        key_dim = self.num_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        hidden = config.hidden_size

        self.q_proj = nn.Linear(hidden, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, value_dim, bias=False)
        self.a_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.q_conv1d = ShortConvolution(key_dim, config.conv_size, config.conv_bias)
        self.k_conv1d = ShortConvolution(key_dim, config.conv_size, config.conv_bias)
        self.v_conv1d = ShortConvolution(value_dim, config.conv_size, config.conv_bias)
        # Decay rates A ~ U(0, 16) (stored as log) and time steps dt log-uniform in [1e-3, 0.1]
        # (stored as softplus^-1(dt)), as in Mamba-2 / Gated DeltaNet.
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0, 16).log())
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        _mark_no_weight_decay(self.A_log, self.dt_bias)
        self.g_proj = nn.Linear(hidden, value_dim, bias=False) if config.gdn_use_gate else None
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, T, _ = x.shape
        output_gate = [self.g_proj] if self.g_proj is not None else []
        q, k, v, a, b, *g = project(x, self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj,
                                    *output_gate)
        q = self.q_conv1d(q, seq).view(B, T, self.num_heads, self.head_k_dim)
        k = self.k_conv1d(k, seq).view(B, T, self.num_heads, self.head_k_dim)
        v = self.v_conv1d(v, seq).view(B, T, self.num_v_heads, self.head_v_dim)
        # beta = sigmoid(b) (x2 with negative eigenvalues) and g = -exp(A_log) softplus(a + dt_bias) in
        # fp32: the op applies them (inside the kernels' first launch on the GPU).
        o, _ = gated_delta_rule(q, k, v, a, b, cu_seqlens=seq.cu_seqlens,
                                use_qk_l2norm=True, impl=self.impl, chunk_size=self.chunk_size, cp=seq.cp,
                                decay_params=(self.A_log, self.dt_bias),
                                beta_activation="2sigmoid" if self.allow_neg_eigval else "sigmoid")
        gate = g[0].view(B, T, self.num_v_heads, self.head_v_dim) if g else None
        return linear(self.o_norm(o, gate).reshape(B, T, -1), self.o_proj)

