"""gated_delta_rule: chunk vs the naive oracle (float64), documents, state carrying, the summary."""
import pytest
import torch

from gdn_parallel.ops.gated_delta_rule import gated_delta_rule, summarize_segment
from tests.ops.gdn_inputs import gdn_inputs
from tests.seeds import generator


def run(impl, q, k, v, g, beta, h0, **kw):
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl, **kw)
    return o, ht


def outputs_and_grads(impl, inputs, seed=1, **kw):
    o, ht = run(impl, *inputs, **kw)
    gen = generator(seed)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)
    return [o, ht, *grads]


def assert_close_all(actual, expected, names, tol):
    for a, e, name in zip(actual, expected, names):
        err = (a - e).abs().max().item()
        assert err < tol, f"{name}: max abs error {err:.3g}"


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


@pytest.mark.parametrize("B,T,H,HV,K,V,chunk", [
    (2, 37, 2, 2, 8, 8, 16),     # T not a chunk multiple
    (1, 64, 1, 3, 16, 8, 32),    # grouped value heads, T = 2 chunks
    (2, 100, 2, 4, 8, 12, 64),   # H != HV, T not a chunk multiple
    (1, 5, 1, 1, 4, 4, 16),      # shorter than a chunk
])
def test_chunk_matches_naive(B, T, H, HV, K, V, chunk):
    inputs = gdn_inputs(B, T, H, HV, K, V, seed=T + HV)
    expected = outputs_and_grads("naive", inputs)
    actual = outputs_and_grads("chunk", inputs, chunk_size=chunk)
    assert_close_all(actual, expected, NAMES, 1e-10)


def test_chunk_matches_naive_with_l2norm_and_scale():
    inputs = gdn_inputs(1, 40, 2, 4, 8, 8, seed=3)
    expected = outputs_and_grads("naive", inputs, use_qk_l2norm=True, scale=0.3)
    actual = outputs_and_grads("chunk", inputs, use_qk_l2norm=True, scale=0.3, chunk_size=16)
    assert_close_all(actual, expected, NAMES, 1e-10)


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_varlen_equals_documents_run_separately(chunk):
    cu = torch.tensor([0, 3, 40, 41, 90, 150])
    q, k, v, g, beta, h0 = gdn_inputs(1, 150, 2, 4, 8, 8, seed=chunk, num_states=5)
    o, ht = run("chunk", q, k, v, g, beta, h0, cu_seqlens=cu, chunk_size=chunk)
    for i in range(5):
        s, e = cu[i].item(), cu[i + 1].item()
        piece = [x[:, s:e] for x in (q, k, v, g, beta)]
        o_i, ht_i = run("naive", *piece, h0[i:i + 1])
        assert (o[:, s:e] - o_i).abs().max() < 1e-10
        assert (ht[i] - ht_i[0]).abs().max() < 1e-10


def test_varlen_gradients_match_naive():
    cu = torch.tensor([0, 20, 21, 70])
    inputs = gdn_inputs(1, 70, 1, 2, 8, 4, seed=11, num_states=3)
    expected = outputs_and_grads("naive", inputs, cu_seqlens=cu)
    actual = outputs_and_grads("chunk", inputs, cu_seqlens=cu, chunk_size=16)
    assert_close_all(actual, expected, NAMES, 1e-10)


def test_splitting_and_carrying_the_state_equals_the_whole():
    q, k, v, g, beta, h0 = gdn_inputs(2, 90, 2, 2, 8, 8, seed=5, requires_grad=False)
    o, ht = run("chunk", q, k, v, g, beta, h0, chunk_size=16)
    state, pieces = h0, []
    for s, e in ((0, 13), (13, 64), (64, 90)):
        o_i, state = run("chunk", *(x[:, s:e] for x in (q, k, v, g, beta)), state, chunk_size=16)
        pieces.append(o_i)
    assert (torch.cat(pieces, 1) - o).abs().max() < 1e-10
    assert (state - ht).abs().max() < 1e-10


@pytest.mark.parametrize("cu", [None, [0, 7, 80, 100]])
def test_summary_is_the_affine_map_of_the_segment(cu):
    cu = None if cu is None else torch.tensor(cu)
    B = 2 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = gdn_inputs(B, 100, 2, 4, 8, 6, seed=7, requires_grad=False)
    m, s_loc = summarize_segment(k, v, g, beta, cu_seqlens=cu, chunk_size=16)
    for trial in range(3):
        s_in = torch.randn(N, 4, 8, 6, dtype=torch.float64, generator=generator(trial))
        _, s_out = run("naive", q, k, v, g, beta, s_in, cu_seqlens=cu)
        assert (m @ s_in + s_loc - s_out).abs().max() < 1e-10


def test_summary_gradients_match_naive_map():
    """M and S_loc are differentiable (the allgather CP algorithm backpropagates through them)."""
    q, k, v, g, beta, _ = gdn_inputs(1, 40, 1, 2, 4, 4, seed=9)
    s_in = torch.randn(1, 2, 4, 4, dtype=torch.float64, generator=generator(10))
    m, s_loc = summarize_segment(k, v, g, beta, chunk_size=16)
    _, s_out = run("naive", q, k, v, g, beta, s_in)
    grads_a = torch.autograd.grad((m @ s_in + s_loc).sum(), (k, v, g, beta))
    grads_b = torch.autograd.grad(s_out.sum(), (k, v, g, beta))
    for a, b in zip(grads_a, grads_b):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("impl,kw", [("naive", {}), ("chunk", {"chunk_size": 4})])
def test_gradcheck(impl, kw):
    inputs = gdn_inputs(1, 9, 1, 2, 3, 2, seed=13)

    def fn(*xs):
        return run(impl, *xs, cu_seqlens=None, **kw)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_float32_chunk_close_to_float64_oracle():
    inputs = gdn_inputs(1, 200, 2, 2, 16, 16, seed=17, requires_grad=False)
    o64, h64 = run("naive", *inputs)
    o32, h32 = run("chunk", *(x.float() for x in inputs))
    assert o32.dtype == torch.float32 and h32.dtype == torch.float32
    assert (o32.double() - o64).abs().max() / o64.abs().max() < 1e-5
    assert (h32.double() - h64).abs().max() / h64.abs().max() < 1e-5


def test_default_scale_and_no_final_state():
    q, k, v, g, beta, _ = gdn_inputs(1, 10, 1, 1, 4, 4, requires_grad=False)
    o, ht = gated_delta_rule(q, k, v, g, beta, impl="chunk")
    o2, _ = gated_delta_rule(q, k, v, g, beta, impl="naive", scale=4 ** -0.5)
    assert ht is None and (o - o2).abs().max() < 1e-12
