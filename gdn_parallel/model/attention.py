"""Softmax attention token mixer: RoPE (on all of each head, its first channels, or none), grouped KV
heads, optional per-head query/key RMSNorm and sigmoid output gate (Qwen3-Next's gated attention),
sliding window or full causal."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.attention import attention
from ..ops.projections import linear, project
from ..ops.rope import apply_rotary
from .norm import RMSNorm
from .sequence import SequenceInfo


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.attn_num_heads, config.num_kv_heads
        self.head_dim, self.window = config.attn_dim, window
        self.rope_theta, self.impl = config.rope_theta, config.attn_impl
        hidden, bias = config.hidden_size, config.attn_qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        # Optional sigmoid output gate per channel (gated attention).
        self.g_proj = (nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
                       if config.attn_output_gate else None)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        # One weight of the head size each, shared by all query (key) heads.
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.attn_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.attn_qk_norm else None
        self.rotary_dim = config.rotary_dim

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, T, _ = x.shape
        output_gate = [self.g_proj] if self.g_proj is not None else []
        q, k, v, *g = project(x, self.q_proj, self.k_proj, self.v_proj, *output_gate)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        positions = seq.position_ids
        if positions is None:
            positions = torch.arange(T, device=x.device).expand(B, T)
        if self.q_norm is not None and self.k_norm is not None:   # both or neither (attn_qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        o = attention(q, k, v, causal=True, window=self.window, cu_seqlens=seq.cu_seqlens,
                      impl=self.impl, cp=seq.cp, memo=seq.memo).reshape(B, T, -1)
        if g:
            o = o * g[0].sigmoid()
        return linear(o, self.o_proj)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rotary_dim channels of each head (frequencies over those channels, as
        partial rotary in Qwen3-Next); the rest pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, positions, self.rope_theta)
        if self.rotary_dim == 0:
            return x
        rotated = apply_rotary(x[..., :self.rotary_dim].contiguous(), positions, self.rope_theta)
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)
