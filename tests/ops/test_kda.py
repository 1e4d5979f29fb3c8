"""kimi_delta_attention: the chunk form vs the float64 token loop (outputs, final states, gradients of
every input), documents, strong per-channel decays, the gated delta rule as its special case, and
segment summaries chained as context-parallel ranks chain them."""
import pytest
import torch

from gdn_parallel.ops.gated_delta_rule import gated_delta_rule
from gdn_parallel.ops.kda import kimi_delta_attention, summarize_segment
from gdn_parallel.ops.kda.chunk import block_size
from tests.ops.kda_inputs import kda_inputs
from tests.seeds import generator

NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def run(impl, q, k, v, g, beta, h0, **kw):
    return kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl, **kw)


def outputs_and_grads(impl, inputs, seed=1, **kw):
    o, ht = run(impl, *inputs, **kw)
    gen = generator(seed)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)
    return [o, ht, *grads]


def max_error(actual, expected) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def relative_error(actual, expected) -> float:
    """Max abs error over the largest reference magnitude: only for quantities that are not zero."""
    scale = expected.double().abs().max().item()
    assert scale > 0, "relative error of a zero reference"
    return max_error(actual, expected) / scale


def assert_close_all(actual, expected, names, tol):
    for a, e, name in zip(actual, expected, names):
        err = max_error(a, e)
        assert err < tol, f"{name}: max abs error {err:.3g}"


def test_block_size_divides_the_chunk():
    assert [block_size(c) for c in (64, 48, 32, 20, 16, 5, 37)] == [16, 16, 16, 10, 16, 5, 1]


@pytest.mark.parametrize("K,V", [(16, 16), (32, 32), (64, 64), (32, 16), (16, 48)])
def test_float32_chunk_matches_float64_oracle(K, V):
    """Documents, initial states, grouped heads; fp32 chunk form within 1e-5 of the exact result."""
    cu = torch.tensor([0, 50, 51, 130, 200])
    inputs = kda_inputs(1, 200, 1, 2, K, V, seed=K + V, num_states=4, requires_grad=False)
    o64, h64 = run("naive", *inputs, cu_seqlens=cu)
    o32, h32 = run("chunk", *(x.float() for x in inputs), cu_seqlens=cu)
    assert o32.dtype == torch.float32 and h32.dtype == torch.float32
    assert relative_error(o32, o64) < 1e-5
    assert relative_error(h32, h64) < 1e-5


@pytest.mark.parametrize("B,T,H,HV,K,V,chunk", [
    (2, 37, 2, 2, 8, 8, 16),     # T not a chunk multiple, one block per chunk
    (1, 100, 1, 2, 8, 12, 64),   # four blocks of 16 per chunk, grouped heads, K != V
    (1, 70, 2, 2, 6, 4, 20),     # blocks of 10
    (1, 45, 1, 1, 4, 4, 37),     # a prime chunk: blocks of one token, every pair across blocks
    (1, 5, 1, 1, 4, 4, 64),      # shorter than a chunk
])
def test_chunk_matches_naive_with_gradients(B, T, H, HV, K, V, chunk):
    inputs = kda_inputs(B, T, H, HV, K, V, seed=T + HV)
    expected = outputs_and_grads("naive", inputs)
    actual = outputs_and_grads("chunk", inputs, chunk_size=chunk)
    assert_close_all(actual, expected, NAMES, 1e-10)


def test_documents_with_gradients_match_naive():
    cu = torch.tensor([0, 20, 21, 70, 101])
    inputs = kda_inputs(1, 101, 1, 2, 8, 4, seed=11, num_states=4)
    expected = outputs_and_grads("naive", inputs, cu_seqlens=cu)
    actual = outputs_and_grads("chunk", inputs, cu_seqlens=cu, chunk_size=32)
    assert_close_all(actual, expected, NAMES, 1e-10)


def test_documents_restart_from_their_own_state():
    cu = torch.tensor([0, 3, 40, 41, 90, 150])
    q, k, v, g, beta, h0 = kda_inputs(1, 150, 2, 4, 8, 8, seed=12, num_states=5, requires_grad=False)
    o, ht = run("chunk", q, k, v, g, beta, h0, cu_seqlens=cu)
    for i in range(5):
        s, e = cu[i].item(), cu[i + 1].item()
        o_i, ht_i = run("naive", *(x[:, s:e] for x in (q, k, v, g, beta)), h0[i:i + 1])
        assert max_error(o[:, s:e], o_i) < 1e-10
        assert max_error(ht[i], ht_i[0]) < 1e-10


def test_l2norm_and_scale_match_naive():
    inputs = kda_inputs(1, 40, 2, 4, 8, 8, seed=3)
    expected = outputs_and_grads("naive", inputs, use_qk_l2norm=True, scale=0.3)
    actual = outputs_and_grads("chunk", inputs, use_qk_l2norm=True, scale=0.3, chunk_size=32)
    assert_close_all(actual, expected, NAMES, 1e-10)


def strongly_decaying_inputs(dtype, seed):
    """Half the channels forget within a token (g near -24, a chunk's cumulative decay near -1500,
    beyond exp's range even in float64), half keep (g near 0)."""
    keep = kda_inputs(1, 150, 1, 2, 16, 16, dtype=dtype, seed=seed, requires_grad=False)
    forget = kda_inputs(1, 150, 1, 2, 16, 16, dtype=dtype, seed=seed + 1, decay_shift=-24.0,
                        requires_grad=False)[3]
    channel = torch.arange(16) % 2 == 0
    keep[3] = torch.where(channel, keep[3], forget)
    assert keep[3].min() < -12
    return keep


def test_strong_decays_stay_finite_and_exact():
    inputs = strongly_decaying_inputs(torch.float64, seed=21)
    for x in inputs:
        x.requires_grad_(True)
    expected = outputs_and_grads("naive", inputs)
    actual = outputs_and_grads("chunk", inputs)
    assert all(bool(a.isfinite().all()) for a in actual)
    assert_close_all(actual, expected, NAMES, 1e-10)


def test_strong_decays_in_float32():
    inputs = strongly_decaying_inputs(torch.float64, seed=23)
    o64, h64 = run("naive", *inputs)
    o32, h32 = run("chunk", *(x.float() for x in inputs))
    assert relative_error(o32, o64) < 1e-5
    assert relative_error(h32, h64) < 1e-5


@pytest.mark.parametrize("chunk", [16, 64])
def test_equal_channel_decays_are_the_gated_delta_rule(chunk):
    """KDA with g the same for every key channel is GDN, gradients included (GDN's dg is the sum of
    KDA's over the channels)."""
    cu = torch.tensor([0, 30, 120])
    q, k, v, g, beta, h0 = kda_inputs(1, 120, 2, 4, 8, 6, seed=31 + chunk, num_states=2)
    g_head = g[..., 0].detach().requires_grad_(True)
    g_channels = g_head.detach()[..., None].expand(-1, -1, -1, 8).clone().requires_grad_(True)
    common = dict(cu_seqlens=cu, chunk_size=chunk)
    gdn = [*gated_delta_rule(q, k, v, g_head, beta, initial_state=h0, output_final_state=True,
                             impl="chunk", **common)]
    kda = [*run("chunk", q, k, v, g_channels, beta, h0, **common)]
    assert_close_all(kda, gdn, ["o", "final_state"], 1e-12)
    gen = generator(32)
    do, dht = (torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in gdn)
    grads_gdn = torch.autograd.grad((gdn[0] * do).sum() + (gdn[1] * dht).sum(), (q, k, v, g_head, beta, h0))
    grads_kda = list(torch.autograd.grad((kda[0] * do).sum() + (kda[1] * dht).sum(),
                                         (q, k, v, g_channels, beta, h0)))
    grads_kda[3] = grads_kda[3].sum(-1)
    assert_close_all(grads_kda, grads_gdn, NAMES[2:], 1e-11)


def test_equal_channel_decays_are_the_gated_delta_rule_in_float32():
    q, k, v, g, beta, h0 = (x.float() for x in kda_inputs(2, 100, 1, 2, 32, 32, seed=33, requires_grad=False))
    g = g[..., :1].expand_as(g)
    o_gdn, h_gdn = gated_delta_rule(q, k, v, g[..., 0], beta, initial_state=h0, output_final_state=True,
                                    impl="chunk")
    o_kda, h_kda = run("chunk", q, k, v, g, beta, h0)
    assert relative_error(o_kda, o_gdn) < 1e-5
    assert relative_error(h_kda, h_gdn) < 1e-5


@pytest.mark.parametrize("cu", [None, [0, 7, 80, 100]])
def test_summary_is_the_affine_map_of_the_segment(cu):
    cu = None if cu is None else torch.tensor(cu)
    B = 2 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = kda_inputs(B, 100, 2, 4, 8, 6, seed=41, requires_grad=False)
    m, s_loc = summarize_segment(k, v, g, beta, cu_seqlens=cu, chunk_size=32)
    assert m.shape == (N, 4, 8, 8) and s_loc.shape == (N, 4, 8, 6)
    for trial in range(3):
        s_in = torch.randn(N, 4, 8, 6, dtype=torch.float64, generator=generator(42 + trial))
        _, s_out = run("naive", q, k, v, g, beta, s_in, cu_seqlens=cu)
        assert max_error(m @ s_in + s_loc, s_out) < 1e-10


@pytest.mark.parametrize("cuts", [[70], [13, 90], [20, 64, 129]])
def test_chained_segment_summaries_reproduce_the_whole_sequence(cuts):
    """Segments as CP ranks hold them: each summarised alone, the summaries folded into every
    segment's incoming state; a local run from it reproduces the whole sequence's outputs, and the
    fold its final state."""
    q, k, v, g, beta, h0 = kda_inputs(2, 150, 1, 2, 16, 8, seed=51 + len(cuts), requires_grad=False)
    o_whole, h_whole = run("naive", q, k, v, g, beta, h0)
    bounds = [0, *cuts, 150]
    state, pieces = h0, []
    for s, e in zip(bounds[:-1], bounds[1:]):
        segment = [x[:, s:e] for x in (q, k, v, g, beta)]
        o_piece, _ = run("chunk", *segment, state, chunk_size=32)
        pieces.append(o_piece)
        m, s_loc = summarize_segment(*segment[1:], chunk_size=32)
        state = m @ state + s_loc
    assert max_error(state, h_whole) < 1e-10
    assert max_error(torch.cat(pieces, dim=1), o_whole) < 1e-10


def test_chained_summaries_in_float32():
    q, k, v, g, beta, h0 = kda_inputs(1, 192, 1, 1, 32, 32, seed=55, requires_grad=False)
    _, h_whole = run("naive", q, k, v, g, beta, h0)
    state = h0.float()
    for s, e in ((0, 50), (50, 128), (128, 192)):
        m, s_loc = summarize_segment(*(x[:, s:e].float() for x in (k, v, g, beta)))
        assert m.dtype == torch.float32
        state = m @ state + s_loc
    assert relative_error(state, h_whole) < 1e-5


def test_summary_gradients_match_naive_map():
    """M and S_loc are differentiable (a context-parallel backward runs through them)."""
    q, k, v, g, beta, _ = kda_inputs(1, 40, 1, 2, 4, 4, seed=61)
    s_in = torch.randn(1, 2, 4, 4, dtype=torch.float64, generator=generator(62))
    m, s_loc = summarize_segment(k, v, g, beta, chunk_size=32)
    _, s_out = run("naive", q, k, v, g, beta, s_in)
    grads_summary = torch.autograd.grad((m @ s_in + s_loc).sum(), (k, v, g, beta))
    grads_naive = torch.autograd.grad(s_out.sum(), (k, v, g, beta))
    assert_close_all(grads_summary, grads_naive, ["dk", "dv", "dg", "dbeta"], 1e-10)


def test_bfloat16_inputs():
    inputs = kda_inputs(1, 80, 1, 1, 16, 16, seed=71, requires_grad=False)
    o64, h64 = run("naive", *inputs)
    o16, h16 = run("chunk", *(x.bfloat16() for x in inputs[:5]), inputs[5].float())
    assert o16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    assert relative_error(o16, o64) < 1e-2
    assert relative_error(h16, h64) < 1e-2


def test_default_scale_and_no_final_state():
    q, k, v, g, beta, _ = kda_inputs(1, 10, 1, 1, 4, 4, requires_grad=False)
    o, ht = kimi_delta_attention(q, k, v, g, beta, impl="chunk")
    o_naive, _ = kimi_delta_attention(q, k, v, g, beta, impl="naive", scale=4 ** -0.5)
    assert ht is None and max_error(o, o_naive) < 1e-12


@pytest.mark.parametrize("change,match", [
    (lambda x: {**x, "g": x["g"][..., 0]}, "g must be a 4-D tensor.*per key channel"),
    (lambda x: {**x, "g": x["g"][..., :2]}, r"g must have shape \[B, T, HV, K\]"),
    (lambda x: {**x, "g": x["g"].abs() + 0.1}, "g is the log decay"),
    (lambda x: {**x, "beta": x["beta"][..., None]}, "beta must be a 3-D tensor"),
    (lambda x: {**x, "impl": "fused"}, "impl='fused' is not one of"),
    (lambda x: {**x, "impl": "fast"}, "impl='fast' is not one of"),
    (lambda x: {**x, "initial_state": x["initial_state"][:1], "cu_seqlens": torch.tensor([0, 3, 8])},
     "initial_state has 1 states but there are 2"),
])
def test_bad_inputs_name_the_argument(change, match):
    q, k, v, g, beta, h0 = kda_inputs(1, 8, 1, 2, 4, 4, dtype=torch.float32, requires_grad=False)
    args = change(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0))
    with pytest.raises(ValueError, match=match):
        kimi_delta_attention(**args)
