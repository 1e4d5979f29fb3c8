"""Attention: sdpa vs flex vs a dense float64 oracle; windows, GQA, documents, key halo, checks."""
import pytest
import torch

from gdn_parallel.ops.attention import attention, attention_reference, masked_attention
from gdn_parallel.ops.rope import document_ids_from_cu_seqlens
from tests.seeds import generator

T = 19
LAYOUTS = {  # name: (B, H, HKV, D, Dv, cu_seqlens)
    "batch": (2, 4, 4, 8, 8, None),
    "docs_gqa": (1, 4, 2, 8, 8, [0, 5, 6, 13, 19]),
    "mqa_dv": (1, 6, 1, 8, 4, [0, 9, 19]),
}


def _qkv(layout, seed, dtype=torch.float64, grad=False):
    B, H, HKV, D, Dv, cu = LAYOUTS[layout]
    g = generator(seed)
    def mk(*s):
        return torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)
    cu = None if cu is None else torch.tensor(cu)
    return mk(B, T, H, D), mk(B, T, HKV, D), mk(B, T, HKV, Dv), cu


@pytest.mark.parametrize("window", [1, 3, 50, None])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sdpa_flex_reference_agree(layout, window):
    q, k, v, cu = _qkv(layout, seed=10 * list(LAYOUTS).index(layout) + (window or 0))
    ref = attention_reference(q, k, v, window=window, cu_seqlens=cu)
    for impl in ("sdpa", "flex", "auto"):
        out = attention(q, k, v, window=window, cu_seqlens=cu, impl=impl)
        assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10, msg=f"impl={impl}")


def test_window_one_is_identity_on_values_and_scale_is_used():
    q, k, v, cu = _qkv("docs_gqa", seed=3)
    out = attention(q, k, v, window=1, cu_seqlens=cu)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=2))
    ref = attention_reference(q, k, v, cu_seqlens=cu, scale=0.3)
    torch.testing.assert_close(attention(q, k, v, cu_seqlens=cu, scale=0.3), ref)
    assert not torch.allclose(attention(q, k, v, cu_seqlens=cu), ref)


def test_reference_is_plain_softmax_attention():
    """The oracle on one head without masks beyond causality, written out token by token."""
    g = generator(4)
    q, k, v = (torch.randn(1, 6, 1, 3, generator=g, dtype=torch.float64) for _ in range(3))
    ref = attention_reference(q, k, v, window=4)
    for i in range(6):
        js = list(range(max(0, i - 3), i + 1))
        w = torch.softmax(torch.stack([q[0, i, 0] @ k[0, j, 0] for j in js]) / 3 ** 0.5, 0)
        torch.testing.assert_close(ref[0, i, 0], sum(wj * v[0, j, 0] for wj, j in zip(w, js)))


@pytest.mark.parametrize("window", [2, None])
@pytest.mark.parametrize("layout", ["batch", "docs_gqa", "mqa_dv"])
def test_sdpa_gradients_match_reference(layout, window):
    q, k, v, cu = _qkv(layout, seed=11, grad=True)
    out = attention(q, k, v, window=window, cu_seqlens=cu, impl="sdpa")
    ref = attention_reference(q, k, v, window=window, cu_seqlens=cu)
    dout = torch.randn(out.shape, generator=generator(12), dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"d{name}")


def test_float32_sdpa_and_flex_agree():
    q, k, v, cu = _qkv("docs_gqa", seed=5, dtype=torch.float32)
    ref = attention_reference(q, k, v, window=4, cu_seqlens=cu)
    for impl in ("sdpa", "flex"):
        torch.testing.assert_close(attention(q, k, v, window=4, cu_seqlens=cu, impl=impl), ref,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("window,start,halo,n", [(4, 7, 3, 6), (4, 7, 5, 6), (7, 8, 6, 3), (None, 10, 10, 9)])
def test_key_halo_equals_rows_of_whole_sequence(impl, window, start, halo, n):
    """Queries [s, s+n) over keys [s-h, s+n) (a context-parallel shard and its halo) give the
    same rows as attention over the whole packed row, documents crossing the shard boundary."""
    q, k, v, cu = _qkv("docs_gqa", seed=21)
    whole = attention_reference(q, k, v, window=window, cu_seqlens=cu)
    doc = document_ids_from_cu_seqlens(cu, T)
    qs, ks = slice(start, start + n), slice(start - halo, start + n)
    index = torch.arange(T)
    out = masked_attention(q[:, qs], k[:, ks], v[:, ks], q_index=index[qs], k_index=index[ks],
                           q_doc=doc[qs], k_doc=doc[ks], window=window, impl=impl)
    torch.testing.assert_close(out, whole[:, qs], atol=1e-10, rtol=1e-10)


def test_unordered_keys_give_the_same_result():
    q, k, v, cu = _qkv("docs_gqa", seed=22)
    doc, index = document_ids_from_cu_seqlens(cu, T), torch.arange(T)
    perm = torch.randperm(T, generator=generator(0))
    out = masked_attention(q, k[:, perm], v[:, perm], q_index=index, k_index=index[perm], q_doc=doc,
                           k_doc=doc[perm], window=3)
    torch.testing.assert_close(out, attention_reference(q, k, v, window=3, cu_seqlens=cu))
    with pytest.raises(ValueError, match="sees no key"):  # dense check path: own token removed
        masked_attention(q, k[:, perm[1:]], v[:, perm[1:]], q_index=index, k_index=index[perm[1:]],
                         q_doc=doc, k_doc=doc[perm[1:]], window=1)


def test_query_without_keys_raises():
    q, k, v, cu = _qkv("docs_gqa", seed=23)
    doc, index = document_ids_from_cu_seqlens(cu, T), torch.arange(T)
    # keys stop at token 10; query 13 opens a document, so it has nothing to look at
    with pytest.raises(ValueError, match="sees no key"):
        masked_attention(q[:, 10:], k[:, :10], v[:, :10], q_index=index[10:], k_index=index[:10],
                         q_doc=doc[10:], k_doc=doc[:10], window=None)
    # the halo is too far back for window 2
    with pytest.raises(ValueError, match="sees no key"):
        masked_attention(q[:, 10:12], k[:, 6:9], v[:, 6:9], q_index=index[10:12], k_index=index[6:9],
                         q_doc=doc[10:12], k_doc=doc[6:9], window=2)


def test_bad_inputs_name_the_argument():
    q, k, v, cu = _qkv("docs_gqa", seed=0)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=True)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match="heads"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="k "):
        attention(q, k.float(), v)
    with pytest.raises(ValueError, match="v "):
        attention(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="q "):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="causal"):
        attention(q, k, v, causal=False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention(q, k, v, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="k_index"):
        masked_attention(q, k, v, q_index=torch.arange(T), k_index=torch.arange(T - 1),
                         q_doc=torch.zeros(T), k_doc=torch.zeros(T), window=None)
    with pytest.raises(ValueError, match="q_doc"):
        masked_attention(q, k, v, q_index=torch.arange(T), k_index=torch.arange(T),
                         q_doc=torch.zeros(T), k_doc=torch.zeros(T, dtype=torch.long), window=None)
    with pytest.raises(ValueError, match="impl"):  # FlexAttention has no CPU backward
        attention(q.requires_grad_(), k, v, impl="flex")
