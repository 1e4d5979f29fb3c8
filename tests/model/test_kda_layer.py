"""The Kimi Delta Attention layer (model/kda.py): its chunk form equals the token loop, forward and
backward; it has fla's KimiDeltaAttention parameters (names, shapes) and computes what fla's layer
computes with them; a model of K layers trains."""
from importlib.util import find_spec

import pytest
import torch

from gdn_parallel.config import ModelConfig
from gdn_parallel.model import MIXERS, HybridLM, KimiDeltaAttention, SequenceInfo
from gdn_parallel.model.norm import GatedRMSNorm
from gdn_parallel.ops.kda import KDA_IMPLS, kimi_delta_attention
from tests.compare import assert_close_set
from tests.seeds import seed_torch

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, n_layers=2, layer_pattern="KA", kda_num_heads=2,
                     kda_num_v_heads=4, kda_head_dim=8, kda_chunk_size=8, conv_bias=True, attn_num_heads=4,
                     attn_num_kv_heads=2, attn_rotary_dim=0, intermediate_size=48)


def outputs_and_gradients(layer, x, cu, impl):
    layer.impl = impl
    x = x.clone().requires_grad_()
    y = layer(x, SequenceInfo(cu_seqlens=cu))
    dy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    (y * dy).sum().backward()
    grads = {f"d{name}": p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    return {"y": y.detach(), "dx": x.grad, **grads}


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_chunk_layer_equals_the_token_loop_forward_and_backward(allow_neg_eigval):
    """Documents of 5, 12 and 13 tokens over chunks of 8; grouped value heads; every parameter's
    gradient (A_log, dt_bias and the low-rank projections included)."""
    seed_torch(0)
    config = ModelConfig(**{**CONFIG.__dict__, "kda_allow_neg_eigval": allow_neg_eigval})
    layer = KimiDeltaAttention(config).double()
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    cu = torch.tensor([0, 5, 17, 30])
    chunk = outputs_and_gradients(layer, x, cu, "chunk")
    naive = outputs_and_gradients(layer, x, cu, "naive")
    assert all(g.abs().sum() > 0 for g in chunk.values())
    assert_close_set(chunk, naive, 1e-10, f"allow_neg_eigval={allow_neg_eigval}")


def test_the_layer_has_fla_parameters():
    """fla-core's KimiDeltaAttention with the same sizes holds the same parameter names and shapes, so
    weights move between the two by name."""
    if find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed (pip install -e '.[dev]')")
    from fla.layers.kda import KimiDeltaAttention as FlaKDA
    ours = KimiDeltaAttention(ModelConfig(hidden_size=32, kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=8,
                                          kda_expand_v=2.0))
    theirs = FlaKDA(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2.0)
    shapes = [{name: p.shape for name, p in layer.named_parameters()} for layer in (ours, theirs)]
    assert shapes[0] == shapes[1]
    assert ours.A_log._no_weight_decay and ours.dt_bias._no_weight_decay
    assert bool((ours.A_log.exp() >= 1).all() and (ours.A_log.exp() <= 16).all())


def test_the_layer_computes_the_math_of_its_docstring():
    """Written out step by step from the layer's parameters (model/kda.py's docstring): the op's
    activations, the q/k norm, the low-rank projections and the sigmoid-gated output norm."""
    seed_torch(1)
    layer = KimiDeltaAttention(CONFIG).double()
    layer.impl = "naive"
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    silu, seq = torch.nn.functional.silu, SequenceInfo()

    def conv(conv1d, h):  # causal depthwise convolution over each row, then SiLU
        width = conv1d.weight.shape[-1]
        padded = torch.nn.functional.pad(h.transpose(1, 2), (width - 1, 0))
        return silu(torch.nn.functional.conv1d(padded, conv1d.weight, conv1d.bias,
                                               groups=h.shape[-1]).transpose(1, 2))

    HV, K, V = 4, 8, 8
    q = conv(layer.q_conv1d, layer.q_proj(x)).view(2, 11, 2, K)
    k = conv(layer.k_conv1d, layer.k_proj(x)).view(2, 11, 2, K)
    v = conv(layer.v_conv1d, layer.v_proj(x)).view(2, 11, HV, V)
    q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))   # ops' l2 norm
    g = -layer.A_log.exp()[:, None] * torch.nn.functional.softplus(
        layer.f_proj(x).view(2, 11, HV, K) + layer.dt_bias.view(HV, K))
    beta = layer.b_proj(x).sigmoid()
    o, _ = kimi_delta_attention(q, k, v, g, beta, impl="naive")
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + CONFIG.norm_eps) * layer.o_norm.weight
    expected = layer.o_proj((normed * layer.g_proj(x).view(2, 11, HV, V).sigmoid()).reshape(2, 11, -1))
    assert_close_set({"y": layer(x, seq)}, {"y": expected}, 1e-12, "step by step")


def test_the_sigmoid_gated_norm_and_its_refusal():
    norm = GatedRMSNorm(4, eps=1e-6, activation="sigmoid")
    x, gate = torch.randn(3, 4), torch.randn(3, 4)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(gate)
    assert torch.allclose(norm(x, gate), expected, atol=1e-6)
    with pytest.raises(ValueError, match="activation='tanh'"):
        GatedRMSNorm(4, activation="tanh")


def test_the_config_offers_the_implementations_the_op_has():
    """The config's choices are the op's, and an implementation the op lacks is refused by name."""
    field = next(f for f in ModelConfig.__dataclass_fields__.values() if f.name == "kda_impl")
    assert field.metadata["choices"] == KDA_IMPLS and "triton" in KDA_IMPLS
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="impl='fused' is not one of"):
        kimi_delta_attention(q, q, q, -torch.rand(1, 4, 1, 8), torch.rand(1, 4, 1), impl="fused")


def test_a_model_of_kda_layers_trains():
    """The tiny hybrid (KDA and full attention without RoPE): finite, falling loss over a few steps;
    every KDA parameter gets a gradient."""
    seed_torch(0)
    model = HybridLM(CONFIG)
    assert isinstance(model.layers[0].attn, MIXERS["K"].module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (1, 40))
    cu = torch.tensor([0, 13, 40])
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids, cu_seqlens=cu).loss
        loss.backward()
        kda = model.layers[0].attn
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in kda.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses
