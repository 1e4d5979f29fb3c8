"""Kimi Delta Attention under context parallelism (ops/kda/cp.py: the gated delta rule's relay and
summary all-gather with KDA's chunk form, and with its Triton kernels run whole, here in Triton's
interpreter) equals one process: outputs, final states, every gradient."""
import pytest
import torch
import torch.distributed as dist

from gdn_parallel.comm import CPContext
from gdn_parallel.ops.kda import kimi_delta_attention
from tests.compare import assert_close_set
from tests.ops.kda_inputs import kda_inputs
from tests.parallel.launcher import SharedLaunch
from tests.parallel.test_cp_gdn import CASES
from tests.seeds import generator


def shard_of(cp, cu):
    s, e = cp.start, cp.end
    starting = [d for d in range(len(cu) - 1) if s <= cu[d] < e]
    ending = [d for d in range(len(cu) - 1) if s < cu[d + 1] <= e]
    return s, e, starting, ending


def check_case(rank, world, cu, algorithm, dtype, H, HV, tol, seed, chunk_size, decay_shift=2.0,
               impl="auto", K=8, V=6):
    total = cu[-1]
    inputs = kda_inputs(1, total, H, HV, K, V, dtype=dtype, seed=seed, num_states=len(cu) - 1,
                        decay_shift=decay_shift)
    gen = generator(seed + 1)
    do = torch.randn(1, total, HV, V, generator=gen, dtype=dtype)
    dht = torch.randn(len(cu) - 1, HV, K, V, generator=gen, dtype=dtype)
    q, k, v, g, beta, h0 = inputs
    o_ref, ht_ref = kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         cu_seqlens=torch.tensor(cu), impl="chunk", chunk_size=chunk_size)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), inputs)

    cp = CPContext.build(dist.group.WORLD, torch.tensor(cu), total // world, algorithm)
    s, e, starting, ending = shard_of(cp, cu)
    local = [x.detach()[:, s:e].clone().requires_grad_() for x in inputs[:5]]
    h0_local = h0.detach()[starting].clone().requires_grad_()
    o, ht = kimi_delta_attention(*local, initial_state=h0_local, output_final_state=True, cp=cp,
                                 chunk_size=chunk_size, impl=impl)
    ((o * do[:, s:e]).sum() + (ht * dht[ending]).sum()).backward()
    cp.finish()

    tag = f"cu={cu}, {algorithm}, rank {rank}"
    assert_close_set({"o": o}, {"o": o_ref.detach()[:, s:e]}, tol, tag)
    assert ht.shape[0] == len(ending)
    if ending:
        assert_close_set({"final_state": ht}, {"final_state": ht_ref.detach()[ending]}, tol, tag)
    names = ["dq", "dk", "dv", "dg", "dbeta"]
    actual = {name: x.grad for name, x in zip(names, local)}
    expected = {name: ref[:, s:e] for name, ref in zip(names, grads_ref)}
    if starting:
        actual["dh0"], expected["dh0"] = h0_local.grad, grads_ref[5][starting]
    assert_close_set(actual, expected, tol, tag)


def check_gate_activation_case(rank, world, cu, algorithm):
    """Decay and beta logits in, Kimi's activations inside the op (A_log [HV], dt_bias [HV * K]), q and k
    normalised by it: each rank's share of the A_log and dt_bias gradients, summed over the ranks here
    (as the CP gradient reduction does in training), is the whole row's."""
    total, HV, K = cu[-1], 2, 8
    q, k, v, *_ = kda_inputs(1, total, 1, HV, K, 6, seed=70, requires_grad=False)
    gen = generator(71)
    f = torch.randn(1, total, HV, K, generator=gen, dtype=torch.float64)
    b = torch.randn(1, total, HV, generator=gen, dtype=torch.float64)
    A_log = torch.rand(HV, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=torch.float64) - 3.0
    do = torch.randn(1, total, HV, 6, generator=gen, dtype=torch.float64)
    cp = CPContext.build(dist.group.WORLD, torch.tensor(cu), total // world, algorithm)
    s, e, _, _ = shard_of(cp, cu)

    def grads(shard):
        leaves = [x.detach()[:, s:e] if shard else x.detach() for x in (q * 2.0, k * 3.0, v, f, b)]
        leaves = [x.clone().requires_grad_() for x in leaves + [A_log, dt_bias]]
        where = dict(cp=cp) if shard else dict(cu_seqlens=torch.tensor(cu))
        o, _ = kimi_delta_attention(*leaves[:5], chunk_size=8, decay_params=tuple(leaves[5:]),
                                    beta_activation="2sigmoid", use_qk_l2norm=True, **where)
        (o * (do[:, s:e] if shard else do)).sum().backward()
        return [o.detach()] + [x.grad for x in leaves]

    expected, actual = grads(False), grads(True)
    cp.finish()
    for p in actual[6:]:
        dist.all_reduce(p)
    tag = f"gates, {algorithm}, rank {rank}"
    names = ["o", "dq", "dk", "dv", "df", "db", "dA_log", "ddt_bias"]
    shard_expected = [expected[0][:, s:e]] + [ref[:, s:e] for ref in expected[1:6]] + expected[6:]
    assert_close_set(dict(zip(names, actual)), dict(zip(names, shard_expected)), 1e-9, tag)


def all_cases(rank, world, algorithm):
    for i, name in enumerate(["one_doc_all_ranks", "short_docs_and_one_crossing", "three_crossings",
                              "tiny_docs"]):
        H, HV = (2, 4) if i % 2 else (2, 2)          # grouped value heads in every other case
        check_case(rank, world, CASES[name], algorithm, torch.float64, H, HV, 1e-9, seed=i, chunk_size=8)
    # channels that forget within a few tokens, across the rank boundaries
    check_case(rank, world, CASES["two_crossings"], algorithm, torch.float64, 1, 2, 1e-9, seed=7,
               chunk_size=8, decay_shift=-3.0)
    # fp32 at the product tolerance
    check_case(rank, world, CASES["three_crossings"], algorithm, torch.float32, 1, 2, 1e-5, seed=99,
               chunk_size=16)
    check_gate_activation_case(rank, world, CASES["two_crossings"], algorithm)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algorithm", ["relay", "allgather"])
def test_cp_kimi_delta_attention_matches_single_process(world, algorithm):
    assert all(CP_CASES((world, algorithm)))


def triton_cases(rank, world, algorithm):
    """The kernels on each shard (fp32 in the interpreter; grouped heads are the single-process tests'),
    an initial state for every document. Four ranks: one document crosses ranks 0, 1 and 2 (rank 1 lies
    inside it), the next crosses 2 and 3. Two: one document crosses the boundary."""
    cu = [0, 40, 150, 256] if world == 4 else [0, 40, 100, 128]
    check_case(rank, world, cu, algorithm, torch.float32, 1, 1, 2e-5, seed=80, chunk_size=64, impl="triton",
               K=16, V=16)
    return True


@pytest.mark.parametrize("world, algorithm", [(4, "relay"), (2, "allgather")])
def test_cp_triton_matches_single_process(world, algorithm):
    """The relay on four ranks (the first only sends, the last only receives, the middle ones both: the
    kernels' hand-overs in every combination); the all-gather's one run on widened values on two (a
    rank continuing from an earlier one is all it needs), sharing that launch with the other 2-rank
    cases: the interpreter's kernels are the suite's slow part."""
    assert all(CP_CASES(("triton", world, algorithm)))


def test_a_cp_call_names_what_it_refuses():
    """The checks the gated delta rule's CP call makes (ops/gated_delta_rule/cp.py, check_cp_call)."""
    cp = CPContext.build(None, [0, 16], 8, rank=0, size=2)
    q, k, v, g, beta, _ = kda_inputs(1, 8, 1, 1, 8, 6, requires_grad=False)
    for change, match in ((dict(impl="naive"), "impl='naive' is the single-process oracle"),
                          (dict(cu_seqlens=torch.tensor([0, 8])), "cu_seqlens and cp exclude each other")):
        with pytest.raises(ValueError, match=match):
            kimi_delta_attention(q, k, v, g, beta, cp=cp, **change)
    with pytest.raises(ValueError, match="the local tensors have 4 tokens but the CP plan has 8"):
        kimi_delta_attention(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], cp=cp)


# Cases run in launches shared by world size across the modules (tests/parallel/launcher.py, SharedLaunch).
CP_CASES = SharedLaunch({
    **{(world, algorithm): (world, all_cases, algorithm)
       for world in (2, 4) for algorithm in ("relay", "allgather")},
    **{("triton", world, algorithm): (world, triton_cases, algorithm)
       for world, algorithm in ((4, "relay"), (2, "allgather"))}})
