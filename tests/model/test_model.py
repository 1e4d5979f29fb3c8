"""HybridLM: forward/backward, documents isolated, flash-linear-attention parameter names and shapes."""
import pytest
import torch

from gdn_parallel.config import ConfigError, ModelConfig
from gdn_parallel.model import HybridLM
from tests.seeds import seed_torch


def tiny(**overrides):
    base = dict(vocab_size=64, hidden_size=32, n_layers=3, layer_pattern="GSA", gdn_num_heads=2,
                gdn_head_dim=8, attn_num_heads=4, window_size=5, gdn_chunk_size=16, intermediate_size=48)
    base.update(overrides)
    return ModelConfig(**base)


def test_forward_backward_every_parameter_gets_a_gradient():
    seed_torch(0)
    model = HybridLM(tiny()).double()
    ids = torch.randint(0, 64, (2, 21))
    out = model(ids, labels=ids)
    assert out.loss.isfinite() and out.num_tokens == 42
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_logits_without_labels():
    model = HybridLM(tiny())
    logits = model(torch.randint(0, 64, (1, 10))).logits
    assert logits.shape == (1, 10, 64)


def test_packed_documents_do_not_see_each_other():
    seed_torch(1)
    model = HybridLM(tiny(gdn_num_v_heads=4)).double()
    cu = torch.tensor([0, 7, 8, 30])
    ids = torch.randint(0, 64, (1, 30))
    packed = model(ids, cu_seqlens=cu).logits
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(ids[:, s:e]).logits
        assert (packed[:, s:e] - alone).abs().max() < 1e-10


def test_packed_loss_is_the_mean_over_labelled_tokens():
    seed_torch(2)
    model = HybridLM(tiny()).double()
    ids = torch.randint(0, 64, (1, 12))
    labels = ids.clone()
    labels[0, 5:] = -100
    out = model(ids, labels=labels)
    logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[0, :5], ids[0, :5])
    assert out.num_tokens == 5 and abs(out.loss.item() - expected.item()) < 1e-12


def test_flash_linear_attention_parameter_names_and_shapes():
    config = tiny(layer_pattern="G", n_layers=1, gdn_num_v_heads=4, gdn_expand_v=2.0)
    shapes = {n: tuple(p.shape) for n, p in HybridLM(config).named_parameters()}
    key, value = 2 * 8, 4 * 16
    expected = {
        "embeddings.weight": (64, 32),
        "layers.0.attn_norm.weight": (32,),
        "layers.0.attn.q_proj.weight": (key, 32),
        "layers.0.attn.k_proj.weight": (key, 32),
        "layers.0.attn.v_proj.weight": (value, 32),
        "layers.0.attn.a_proj.weight": (4, 32),
        "layers.0.attn.b_proj.weight": (4, 32),
        "layers.0.attn.g_proj.weight": (value, 32),
        "layers.0.attn.o_proj.weight": (32, value),
        "layers.0.attn.q_conv1d.weight": (key, 1, 4),
        "layers.0.attn.k_conv1d.weight": (key, 1, 4),
        "layers.0.attn.v_conv1d.weight": (value, 1, 4),
        "layers.0.attn.A_log": (4,),
        "layers.0.attn.dt_bias": (4,),
        "layers.0.attn.o_norm.weight": (16,),
        "layers.0.mlp_norm.weight": (32,),
        "layers.0.mlp.gate_proj.weight": (48, 32),
        "layers.0.mlp.up_proj.weight": (48, 32),
        "layers.0.mlp.down_proj.weight": (32, 48),
        "norm.weight": (32,),
        "lm_head.weight": (64, 32),
    }
    assert shapes == expected


def test_gdn_initialisation_ranges():
    seed_torch(3)
    config = tiny(layer_pattern="G", n_layers=1, gdn_num_heads=64, gdn_head_dim=4)
    attn = HybridLM(config).layers[0].attn
    A = attn.A_log.exp()
    assert A.min() >= 0 and A.max() <= 16
    dt = torch.nn.functional.softplus(attn.dt_bias)
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7
    assert attn.A_log._no_weight_decay and attn.dt_bias._no_weight_decay


def test_negative_eigenvalues_double_beta():
    seed_torch(4)
    model = HybridLM(tiny(layer_pattern="G", n_layers=1, gdn_allow_neg_eigval=True))
    assert model.layers[0].attn.allow_neg_eigval
    model(torch.randint(0, 64, (1, 9)), labels=torch.randint(0, 64, (1, 9))).loss.backward()


def test_tied_embeddings_share_one_tensor():
    model = HybridLM(tiny(tie_word_embeddings=True))
    assert model.lm_head.weight is model.embeddings.weight
    untied = HybridLM(tiny())
    assert model.num_parameters() == untied.num_parameters() - 64 * 32


def test_layer_pattern_tiling_and_explicit():
    assert tiny(layer_pattern="GS", n_layers=4).layer_types == "GSGS"
    assert tiny(layer_pattern="GGS", n_layers=3).layer_types == "GGS"
    symbols = [b.symbol for b in HybridLM(tiny(layer_pattern="GSA", n_layers=3)).layers]
    assert symbols == ["G", "S", "A"]


@pytest.mark.parametrize("overrides,match", [
    (dict(layer_pattern="GX", n_layers=2), "unknown layer symbol"),   # checked once the pattern tiles
    (dict(layer_pattern="GS", n_layers=3), "layer_pattern"),
    (dict(hidden_size=30, attn_num_heads=4), "hidden_size=30 is not divisible by model.attn_num_heads"),
    (dict(gdn_num_v_heads=3), "gdn_num_v_heads"),
    (dict(gdn_head_dim=512), "gdn_head_dim"),
    (dict(attn_num_kv_heads=3), "attn_num_kv_heads"),
    (dict(gdn_impl="fast"), "gdn_impl"),
])
def test_invalid_model_configs_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        HybridLM(tiny(**overrides))


def test_input_shape_errors():
    model = HybridLM(tiny())
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.randint(0, 64, (10,)))
    with pytest.raises(ValueError, match="labels"):
        model(torch.randint(0, 64, (1, 10)), labels=torch.randint(0, 64, (1, 9)))


def test_flops_per_token_is_dominated_by_matmuls():
    model = HybridLM(tiny())
    flops = model.flops_per_token(64)
    assert 6 * model.num_parameters(exclude_embeddings=True) < flops < 12 * model.num_parameters()


def test_packed_documents_cost_full_attention_only_within_each_document():
    config = tiny()   # a GDN, a sliding-window (5 keys) and a full attention layer
    flops = HybridLM(config).training_flops()
    heads, dim = config.attn_num_heads, config.attn_dim

    def attention(lengths, window):  # x3 for training; 2 x 2 FLOPs per key seen and channel
        keys = sum(min(window or i, i) for n in lengths for i in range(1, n + 1))
        return 3 * 4 * keys * heads * dim

    # the GDN and matmul work do not depend on where the row is cut; attention sees keys of its piece
    cuts = [[128], [64, 64], [3, 125], [1] * 128]
    for a, b in zip(cuts, cuts[1:]):
        expected = sum(attention(a, window) - attention(b, window) for window in (None, config.window_size))
        assert flops.of_pieces(a) - flops.of_pieces(b) == pytest.approx(expected, rel=1e-12)
    gdn_only = HybridLM(tiny(n_layers=1, layer_pattern="G")).training_flops()
    assert gdn_only.of_pieces([128]) == gdn_only.of_pieces([64, 64])
