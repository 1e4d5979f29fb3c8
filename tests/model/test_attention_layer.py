"""The attention layer's Qwen3-Next and Kimi Linear variants: per-head query/key RMSNorm before RoPE,
RoPE on the first channels of each head (partial rotary) or none, checked against the formulas."""
import pytest
import torch

from gdn_parallel.config import ConfigError, ModelConfig
from gdn_parallel.model.attention import Attention
from gdn_parallel.model.sequence import SequenceInfo
from gdn_parallel.ops.attention import attention_reference
from gdn_parallel.ops.rope import apply_rotary
from tests.seeds import seed_torch

HEAD = 16


def config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, n_layers=1, layer_pattern="A", attn_num_heads=4,
                attn_num_kv_heads=2, attn_head_dim=HEAD, intermediate_size=48, attn_impl="sdpa")
    return ModelConfig(**{**base, **overrides})


def by_formula(layer: Attention, x: torch.Tensor, rotary: int, qk_norm: bool) -> torch.Tensor:
    """The layer written out: projections, RMSNorm per head, RoPE on the first `rotary` channels
    (its own frequencies over those channels), causal softmax attention, output projection."""
    B, T, _ = x.shape
    q = (x @ layer.q_proj.weight.T).view(B, T, 4, HEAD)
    k = (x @ layer.k_proj.weight.T).view(B, T, 2, HEAD)
    v = (x @ layer.v_proj.weight.T).view(B, T, 2, HEAD)
    if qk_norm:
        def norm(t, weight):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + layer.q_norm.eps) * weight
        q, k = norm(q, layer.q_norm.weight), norm(k, layer.k_norm.weight)
    positions = torch.arange(T)
    if rotary:
        q = torch.cat((apply_rotary(q[..., :rotary], positions), q[..., rotary:]), -1)
        k = torch.cat((apply_rotary(k[..., :rotary], positions), k[..., rotary:]), -1)
    o = attention_reference(q, k, v, causal=True)
    return o.reshape(B, T, -1) @ layer.o_proj.weight.T


@pytest.mark.parametrize("rotary, qk_norm", [(None, False), (4, True), (8, False), (0, True), (HEAD, True)])
def test_attention_variants_match_the_formula(rotary, qk_norm):
    seed_torch(3)
    layer = Attention(config(attn_rotary_dim=rotary, attn_qk_norm=qk_norm), window=None).double()
    if qk_norm:   # weights away from their initial ones, so that a missing weight shows
        torch.nn.init.uniform_(layer.q_norm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(layer.k_norm.weight, 0.5, 1.5)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    expected = by_formula(layer, x, HEAD if rotary is None else rotary, qk_norm)
    torch.testing.assert_close(layer(x, SequenceInfo()), expected, rtol=1e-10, atol=1e-10)


def test_partial_rotary_leaves_the_other_channels_position_free():
    """With 4 of 16 channels rotated, shifting every position changes only those 4 of q."""
    layer = Attention(config(attn_rotary_dim=4), window=None).double()
    x = torch.randn(1, 5, HEAD * 4, dtype=torch.float64).view(1, 5, 4, HEAD)
    at, shifted = layer._rotate(x, torch.arange(5)), layer._rotate(x, torch.arange(5) + 7)
    assert torch.equal(at[..., 4:], shifted[..., 4:]) and torch.equal(at[..., 4:], x[..., 4:])
    assert not torch.allclose(at[..., :4], shifted[..., :4])


def test_qk_norm_weights_are_their_own_parameters_and_get_gradients():
    layer = Attention(config(attn_qk_norm=True), window=None).double()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    layer(x, SequenceInfo()).square().sum().backward()
    assert layer.q_norm.weight.shape == (HEAD,) and layer.k_norm.weight.shape == (HEAD,)
    assert layer.q_norm.weight.grad.abs().sum() > 0 and layer.k_norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("rotary", [3, 18, -2])
def test_a_rotary_dim_that_cannot_rotate_is_refused_naming_the_field(rotary):
    with pytest.raises(ConfigError, match="model.attn_rotary_dim"):
        config(attn_rotary_dim=rotary).validate()


def test_no_rope_allows_an_odd_head_size():
    config(attn_head_dim=15, attn_rotary_dim=0).validate()
    with pytest.raises(ConfigError, match="model.attn_head_dim=15 must be even"):
        config(attn_head_dim=15).validate()
