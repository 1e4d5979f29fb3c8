"""Kimi Delta Attention token mixer (Kimi Linear's KDA layer), with flash-linear-attention's parameter
names, shapes and init (fla's KimiDeltaAttention, fla-core 0.6.0), written from the math:

    q, k = l2norm(silu(conv(x W_q))), l2norm(silu(conv(x W_k)));   v = silu(conv(x W_v))
    g = -exp(A_log) * softplus(f_proj(x) + dt_bias)     a log decay per value head and key channel
    beta = sigmoid(b_proj(x))                            (x2 with negative eigenvalues)
    o = o_proj(rmsnorm(KDA(q, k, v, g, beta)) * o_norm.weight * sigmoid(g_proj(x)))

f_proj and g_proj are low-rank (hidden -> head_v_dim -> HV * K, HV * V), g_proj's second linear with a
bias; A_log is [HV], dt_bias [HV * K].
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.kda import kimi_delta_attention
from ..ops.projections import linear, project
from .gated_deltanet import ShortConvolution, _mark_no_weight_decay
from .norm import GatedRMSNorm
from .sequence import SequenceInfo


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_v_heads = config.kda_num_heads, config.kda_v_heads
        self.head_k_dim, self.head_v_dim = config.kda_head_dim, config.kda_head_v_dim
        self.allow_neg_eigval = config.kda_allow_neg_eigval
        self.chunk_size, self.impl = config.kda_chunk_size, config.kda_impl
        key_dim = self.num_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        gate_dim = self.num_v_heads * self.head_k_dim       # a decay per value head and key channel
        hidden = config.hidden_size

        self.q_proj = nn.Linear(hidden, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, value_dim, bias=False)
        self.q_conv1d = ShortConvolution(key_dim, config.conv_size, config.conv_bias)
        self.k_conv1d = ShortConvolution(key_dim, config.conv_size, config.conv_bias)
        self.v_conv1d = ShortConvolution(value_dim, config.conv_size, config.conv_bias)
        # Low rank through the value head size, as Kimi Linear's layer.
        self.f_proj = nn.Sequential(nn.Linear(hidden, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        # Decay rates A ~ U(1, 16) per value head (stored as log) and time steps dt log-uniform in
        # [1e-3, 0.1] per channel (stored as softplus^-1(dt)), as fla's KimiDeltaAttention.
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(gate_dim) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        _mark_no_weight_decay(self.A_log, self.dt_bias)
        self.g_proj = nn.Sequential(nn.Linear(hidden, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, value_dim, bias=True))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v, f_low, b, gate_low = project(x, self.q_proj, self.k_proj, self.v_proj, self.f_proj[0],
                                              self.b_proj, self.g_proj[0])
        q = self.q_conv1d(q, seq).view(B, T, self.num_heads, self.head_k_dim)
        k = self.k_conv1d(k, seq).view(B, T, self.num_heads, self.head_k_dim)
        v = self.v_conv1d(v, seq).view(B, T, self.num_v_heads, self.head_v_dim)
        f = linear(f_low, self.f_proj[1]).view(B, T, self.num_v_heads, self.head_k_dim)
        # The op applies the decay and beta activations (in fp32) and the q/k L2 norm.
        o, _ = kimi_delta_attention(q, k, v, f, b, cu_seqlens=seq.cu_seqlens, use_qk_l2norm=True,
                                    impl=self.impl, chunk_size=self.chunk_size, cp=seq.cp,
                                    decay_params=(self.A_log, self.dt_bias),
                                    beta_activation="2sigmoid" if self.allow_neg_eigval else "sigmoid")
        gate = self.g_proj[1](gate_low).view(B, T, self.num_v_heads, self.head_v_dim)
        return linear(self.o_norm(o, gate).reshape(B, T, -1), self.o_proj)
