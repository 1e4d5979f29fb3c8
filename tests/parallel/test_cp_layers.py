"""Short conv and attention under context parallelism equal one process (halos incl. multi-hop);
the CP conv's impl reaches the local conv (Triton in the interpreter = the torch path); full attention
under the zigzag split equals one process too and gives every rank the same work."""
import pytest
import torch
import torch.distributed as dist

from gdn_parallel.comm import CPContext
from gdn_parallel.ops.attention import attention
from gdn_parallel.ops.short_conv import causal_conv1d
from tests.compare import assert_close_set, is_degenerate, set_size
from tests.parallel.launcher import SharedLaunch
from tests.seeds import generator


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def conv_case(rank, world, total, cu, width, seed):
    gen = generator(seed)
    D = 6
    x = torch.randn(1, total, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(D, width, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(D, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, total, D, generator=gen, dtype=torch.float64)
    cu_t = torch.tensor(cu)
    y = causal_conv1d(x, w, b, cu_seqlens=cu_t)
    gx, gw, gb = torch.autograd.grad((y * dy).sum(), (x, w, b))

    L = total // world
    s, e = rank * L, (rank + 1) * L
    x_l = x.detach()[:, s:e].clone().requires_grad_()
    w_l, b_l = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    cp = CPContext.build(dist.group.WORLD, cu_t, L)
    y_l = causal_conv1d(x_l, w_l, b_l, cp=cp)
    (y_l * dy[:, s:e]).sum().backward()
    cp.finish()
    tag = f"conv cu={cu} width={width} rank={rank}"
    assert_close_set({"y": y_l}, {"y": y[:, s:e]}, 1e-12, tag)
    assert_close_set({"dx": x_l.grad, "dw": summed(w_l.grad), "db": summed(b_l.grad)},
                     {"dx": gx[:, s:e], "dw": gw, "db": gb}, 1e-12, tag)


def attention_case(rank, world, total, cu, window, seed, H=4, HKV=2):
    gen = generator(seed)
    q = torch.randn(1, total, H, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, total, HKV, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, total, HKV, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    do = torch.randn(1, total, H, 8, generator=gen, dtype=torch.float64)
    cu_t = torch.tensor(cu)
    o = attention(q, k, v, window=window, cu_seqlens=cu_t, impl="sdpa")
    grads = torch.autograd.grad((o * do).sum(), (q, k, v))

    L = total // world
    s, e = rank * L, (rank + 1) * L
    local = [t.detach()[:, s:e].clone().requires_grad_() for t in (q, k, v)]
    cp = CPContext.build(dist.group.WORLD, cu_t, L)
    o_l = attention(*local, window=window, impl="sdpa", cp=cp)
    (o_l * do[:, s:e]).sum().backward()
    cp.finish()
    tag = f"attention cu={cu} window={window} rank={rank}"
    assert_close_set({"o": o_l}, {"o": o[:, s:e]}, 1e-12, tag)
    names = ("dq", "dk", "dv")
    expected = {name: g[:, s:e] for name, g in zip(names, grads)}
    if window == 1:
        # The output is v itself: dq and dk are zero in exact arithmetic, their references rounding
        # noise, so the CP ones are checked as near-zeros against the size of all three gradients.
        scale = set_size(expected.values())
        assert is_degenerate(expected["dq"], scale) and is_degenerate(expected["dk"], scale), tag
    assert_close_set({name: t.grad for name, t in zip(names, local)}, expected, 1e-12, tag)


def layer_cases(rank, world):
    total = 8 * world  # shards of 8 tokens
    doc_layouts = [[0, total], [0, 3, 9, 10, total], [0, 1, 2, total - 1, total]]
    for i, cu in enumerate(doc_layouts):
        for width in (2, 4):
            conv_case(rank, world, total, cu, width, seed=10 * i + width)
        for window in (1, 3, 8, 13, 100, None):  # 13 and 100 need several hops
            attention_case(rank, world, total, cu, window, seed=10 * i + (window or 0))
    # a shard shorter than the conv halo (multi-hop conv): shards of 2 tokens, kernel 4
    conv_case(rank, world, 2 * world, [0, 2 * world], 4, seed=77)
    conv_case(rank, world, 2 * world, [0, 1, 2 * world], 4, seed=78)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_cp_conv_and_attention_match_single_process(world):
    assert all(LAYER_CASES(("layers", world)))


def conv_impl_case(rank, world):
    """impl="triton" under cp runs the Triton kernel on the shard + halo (counted through a
    wrapper) and matches impl="torch": output and gradients, fp32 (the interpreter on CPU)."""
    import gdn_parallel.ops.short_conv.local as sc
    kernel, calls = sc._triton_kernel(), []
    sc._triton_kernel = lambda: lambda *args: calls.append(1) or kernel(*args)  # this process only
    # shards of 8 tokens with halos from one rank, then shards of 2 tokens (kernel 4: two hops)
    for total, cu, seed in ((8 * world, [0, 3, 9, 10, 8 * world], 1), (2 * world, [0, 1, 2 * world], 2)):
        gen = generator(seed)
        D, L = 6, total // world
        x = torch.randn(1, L * world, D, generator=gen)[:, rank * L:(rank + 1) * L]
        w, b = torch.randn(D, 4, generator=gen), torch.randn(D, generator=gen)
        dy = torch.randn(1, L * world, D, generator=gen)[:, rank * L:(rank + 1) * L]
        results = {}
        for impl in ("torch", "triton"):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            before = len(calls)
            cp = CPContext.build(dist.group.WORLD, torch.tensor(cu), L)
            y = causal_conv1d(*leaves, cp=cp, impl=impl)
            (y * dy).sum().backward()
            cp.finish()
            assert (len(calls) > before) == (impl == "triton"), (impl, total, rank)
            results[impl] = [y.detach(), leaves[0].grad, summed(leaves[1].grad), summed(leaves[2].grad)]
        names = ("y", "dx", "dw", "db")
        got, want = (dict(zip(names, results[impl])) for impl in ("triton", "torch"))
        tag = f"total={total} rank={rank}"
        assert_close_set({"y": got.pop("y")}, {"y": want.pop("y")}, 1e-5, tag)
        assert_close_set(got, want, 1e-5, tag)
    return True


def test_cp_conv_impl_triton_matches_torch():
    pytest.importorskip("triton")
    assert all(LAYER_CASES("conv_impl"))


@pytest.mark.parametrize("cu, rank", [([0, 40], 1),            # a halo of the whole window
                                      ([0, 17, 40], 1),        # 3 tokens of the document over the boundary
                                      ([0, 20, 40], 1),        # a document starts at the boundary
                                      ([0, 40], 0)])           # rank 0: nothing before it
def test_sliding_window_keys_have_one_length(cu, rank):
    """Whatever halo a row's documents give a rank, its sliding-window keys have one length (the
    compiled FlexAttention would compile again for each new one), and the free slots change nothing:
    the attention equals the one over the real keys alone."""
    from gdn_parallel.ops.attention.cp import _fixed_halo_keys
    from gdn_parallel.ops.attention.masked import masked_attention

    window, L, heads, dim = 9, 20, 2, 4
    cp = CPContext.build(None, cu, L, rank=rank, size=2)
    gen = generator(11)
    q = torch.randn(1, L, heads, dim, generator=gen, dtype=torch.float64)
    kv_local = torch.randn(1, L, heads, 2 * dim, generator=gen, dtype=torch.float64)
    h = cp.halo_len(window - 1)
    halo = torch.randn(1, h, heads, 2 * dim, generator=gen, dtype=torch.float64) if h else None
    q_index = torch.arange(cp.start, cp.end)
    q_doc = cp.local_doc_ids()
    kv, k_index, k_doc = _fixed_halo_keys(cp, kv_local, halo, window - 1, q_doc)
    assert kv.shape[1] == k_index.shape[0] == k_doc.shape[0] == L + 128   # window - 1 in whole tiles
    real = kv_local if halo is None else torch.cat([halo, kv_local], dim=1)
    real_index = torch.arange(cp.start - h, cp.end)
    real_doc = torch.cat([torch.full((h,), cp.doc_of(cp.start)), q_doc])
    out = masked_attention(q, *kv.split(dim, -1), q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc,
                           window=window, impl="sdpa")
    ref = masked_attention(q, *real.split(dim, -1), q_index=q_index, k_index=real_index, q_doc=q_doc,
                           k_doc=real_doc, window=window, impl="sdpa")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cu", [[0, 96],                 # one document: one on every shard
                                [0, 32, 96],             # a document starts at a shard boundary
                                [0, 30, 50, 96],         # several documents, halos of 2 and 3 tokens
                                [0, 33, 64, 65, 96]])    # a one-token document, a halo of one
def test_cp_conv_runs_one_kernel_variant_a_rank_whatever_the_documents(monkeypatch, cu):
    """Each shard hands the local conv boundaries and (after the first shard) a prefix of one width,
    whatever its documents: Triton compiles a variant per (boundaries or none, prefix or none), and a
    form that followed the data compiled again at the first step that brought it, seconds on one rank
    while the others waited (1M tokens, cp 4). Three sequence chunks of one process, against one run."""
    from gdn_parallel.comm.context import Loopback
    from gdn_parallel.ops.short_conv import cp as cp_conv

    forms = []
    local = cp_conv.causal_conv1d
    def recorded(x, weight, bias, activation, cu_seqlens, prefix, impl):
        forms.append((cu_seqlens is None, None if prefix is None else tuple(prefix.shape)))
        return local(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens, prefix=prefix, impl=impl)
    monkeypatch.setattr(cp_conv, "causal_conv1d", recorded)
    gen = generator(sum(cu))
    x = torch.randn(1, 96, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w, b = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
            for shape in ((5, 4), (5,)))
    dy = torch.randn(1, 96, 5, generator=gen, dtype=torch.float64)
    y = causal_conv1d(x, w, b, cu_seqlens=torch.tensor(cu))
    expected = (y, *torch.autograd.grad((y * dy).sum(), (x, w, b)))
    loopback = Loopback()
    plans = [CPContext(None, r, 3, cu, 32, chunks=3, loopback=loopback) for r in range(3)]
    y_cp = torch.cat([causal_conv1d(x[:, 32 * r:32 * (r + 1)], w, b, cp=plans[r]) for r in range(3)], dim=1)
    got = (y_cp, *torch.autograd.grad((y_cp * dy).sum(), (x, w, b)))
    for name, g, e in zip(("y", "dx", "dw", "db"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=name)
    assert forms == [(False, None), (False, (1, 3, 5)), (False, (1, 3, 5))], forms


def zigzag_case(rank, world, total, cu, seed, dtype, tol, H=4, HKV=2):
    """Full attention of the shard under both splits against one process: outputs and q/k/v
    gradients, each split against the oracle (so zigzag equals contiguous up to rounding)."""
    gen = generator(seed)
    q = torch.randn(1, total, H, 8, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(1, total, HKV, 8, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(1, total, HKV, 8, generator=gen, dtype=dtype, requires_grad=True)
    do = torch.randn(1, total, H, 8, generator=gen, dtype=dtype)
    cu_t = torch.tensor(cu)
    o = attention(q, k, v, cu_seqlens=cu_t, impl="sdpa")
    grads = torch.autograd.grad((o * do).sum(), (q, k, v))
    L = total // world
    s, e = rank * L, (rank + 1) * L
    expected = {"o": o.detach()[:, s:e], **{n: g[:, s:e] for n, g in zip(("dq", "dk", "dv"), grads)}}
    for split in ("zigzag", "contiguous"):
        local = [t.detach()[:, s:e].clone().requires_grad_() for t in (q, k, v)]
        cp = CPContext.build(dist.group.WORLD, cu_t, L, attention_split=split)
        o_l = attention(*local, impl="sdpa", cp=cp)
        (o_l * do[:, s:e]).sum().backward()
        cp.finish()
        got = {"o": o_l.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), local)}}
        assert_close_set(got, expected, tol, f"{split} attention cu={cu} {dtype} rank={rank}")
    return True


def zigzag_cases(rank, world):
    total = 8 * world   # shards of 8 tokens, query blocks of 4
    layouts = [[0, total],
               # boundaries inside blocks (3, 6, 9), at a block edge inside a shard (4), documents
               # over a block edge (6..9 crosses the first rank boundary) and over several ranks
               [0, 3, 4, 6, 9, total - 5, total],
               [0, 1, 2, total - 1, total]]          # one-token documents at both ends
    for i, cu in enumerate(layouts):
        zigzag_case(rank, world, total, cu, seed=100 + i, dtype=torch.float64, tol=1e-12)
    # fp32, longer blocks (shards of 24 tokens) with documents over every rank boundary
    total = 24 * world
    zigzag_case(rank, world, total, [0, 5, 30, total - 7, total], seed=120, dtype=torch.float32, tol=1e-5)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_attention_matches_single_process(world):
    assert all(LAYER_CASES(("zigzag", world)))


def pair_count_case(rank, world):
    """The (query, key) pairs each rank's full attention is given, one document over the row, under
    both splits: what masked_attention receives on this rank, counted by the mask rule."""
    import importlib
    cp_module = importlib.import_module("gdn_parallel.ops.attention.cp")  # ops.attention is also a function
    real, seen = cp_module.masked_attention, []

    def counting(q, k, v, *, q_index, k_index, q_doc, k_doc, **kwargs):
        allowed = (q_doc[:, None] == k_doc[None]) & (q_index[:, None] >= k_index[None])
        seen.append((int(allowed.sum()), q_index.tolist()))
        return real(q, k, v, q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc, **kwargs)

    total, counts = 16 * world, {}
    cp_module.masked_attention = counting
    try:
        for split in ("contiguous", "zigzag"):
            L = total // world
            shard = [torch.randn(1, L, 2, 4, generator=generator(rank)) for _ in range(3)]
            cp = CPContext.build(dist.group.WORLD, [0, total], L, attention_split=split)
            attention(*shard, impl="sdpa", cp=cp)
            counts[split] = seen.pop()
    finally:
        cp_module.masked_attention = real
    return counts


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_gives_every_rank_the_same_attention_work(world):
    """Contiguous: rank r computes (2r + 1) / n² of the pairs; zigzag: 1 / n each, the queries of
    all ranks together being every token once."""
    by_rank = LAYER_CASES(("pair counts", world))
    total = 16 * world
    everything = total * (total + 1) // 2
    contiguous = [counts["contiguous"][0] for counts in by_rank]
    zigzag = [counts["zigzag"][0] for counts in by_rank]
    assert contiguous == sorted(set(contiguous)) and sum(contiguous) == everything, contiguous
    assert zigzag == [everything // world] * world, zigzag
    queries = sorted(i for counts in by_rank for i in counts["zigzag"][1])
    assert queries == list(range(total))
    block = total // (2 * world)
    assert by_rank[0]["zigzag"][1] == list(range(block)) + list(range(total - block, total))


def test_zigzag_refuses_an_odd_shard_and_the_plan_an_unknown_split():
    """Before any message (no process group here): an odd shard does not halve into query blocks."""
    q = torch.randn(1, 3, 2, 4)
    cp = CPContext.build(None, [0, 6], 3, rank=0, size=2, attention_split="zigzag")
    with pytest.raises(ValueError, match="parallel.cp_attention_split=zigzag .* 3 tokens"):
        attention(q, q, q, impl="sdpa", cp=cp)
    q = torch.randn(1, 4, 2, 4)
    cp = CPContext.build(None, [0, 8], 4, rank=0, size=2, attention_split="ring")
    with pytest.raises(ValueError, match="attention_split 'ring' is not one of"):
        attention(q, q, q, impl="sdpa", cp=cp)


# Shared launches (tests/parallel/launcher.py, SharedLaunch). conv_impl wraps the kernel getter in its
# processes: a pass-through that counts calls, so the cases after it run the same kernel.
LAYER_CASES = SharedLaunch({("layers", 2): (2, layer_cases), ("layers", 4): (4, layer_cases),
                            "conv_impl": (2, conv_impl_case),
                            ("zigzag", 2): (2, zigzag_cases), ("zigzag", 4): (4, zigzag_cases),
                            ("pair counts", 2): (2, pair_count_case),
                            ("pair counts", 4): (4, pair_count_case)})
