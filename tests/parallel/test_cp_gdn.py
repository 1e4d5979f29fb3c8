"""Gated delta rule under context parallelism equals one process: outputs, final states, all grads."""
import pytest
import torch
import torch.distributed as dist

from gdn_parallel.comm import CPContext
from gdn_parallel.ops.gated_delta_rule import gated_delta_rule
from tests.compare import assert_close_set
from tests.ops.gdn_inputs import gdn_inputs
from tests.parallel.launcher import SharedLaunch
from tests.seeds import generator, seed_torch

# 96 tokens; documents crossing 0..3 rank boundaries at CP=4 (shards of 24; at CP=2 shards of 48).
CASES = {
    "aligned": [0, 24, 48, 72, 96],
    "one_doc_all_ranks": [0, 96],
    "short_docs_and_one_crossing": [0, 10, 30, 31, 60, 96],
    "two_crossings": [0, 5, 70, 96],
    "three_crossings": [0, 3, 20, 90, 96],
    "tiny_docs": [0, 1, 2, 23, 25, 47, 49, 50, 95, 96],
}


def reference(inputs, cu, do, dht, chunk_size):
    q, k, v, g, beta, h0 = inputs
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             cu_seqlens=torch.tensor(cu), impl="chunk", chunk_size=chunk_size)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)
    return o.detach(), ht.detach(), grads


def check_case(rank, world, cu, algorithm, dtype, H, HV, tol, seed, chunk_size, impl="chunk"):
    total = cu[-1]
    inputs = gdn_inputs(1, total, H, HV, 8, 6, dtype=dtype, seed=seed, num_states=len(cu) - 1)
    gen = generator(seed + 1)
    do = torch.randn(1, total, HV, 6, generator=gen, dtype=dtype)
    dht = torch.randn(len(cu) - 1, HV, 8, 6, generator=gen, dtype=dtype)
    o_ref, ht_ref, grads_ref = reference(inputs, cu, do, dht, chunk_size)

    cp = CPContext.build(dist.group.WORLD, torch.tensor(cu), total // world, algorithm)
    s, e = cp.start, cp.end
    starting = [d for d in range(len(cu) - 1) if s <= cu[d] < e]
    ending = [d for d in range(len(cu) - 1) if s < cu[d + 1] <= e]
    q, k, v, g, beta = (x.detach()[:, s:e].clone().requires_grad_() for x in inputs[:5])
    h0 = inputs[5].detach()[starting].clone().requires_grad_()
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cp=cp,
                             chunk_size=chunk_size, impl=impl)
    loss = (o * do[:, s:e]).sum() + (ht * dht[ending]).sum()
    loss.backward()
    cp.finish()

    tag = f"cu={cu}, {algorithm}, rank {rank}"
    assert_close_set({"o": o}, {"o": o_ref[:, s:e]}, tol, tag)
    assert ht.shape[0] == len(ending)
    if ending:
        assert_close_set({"final_state": ht}, {"final_state": ht_ref[ending]}, tol, tag)
    names = ["dq", "dk", "dv", "dg", "dbeta"]
    actual = {name: x.grad for name, x in zip(names, (q, k, v, g, beta))}
    expected = {name: ref[:, s:e] for name, ref in zip(names, grads_ref)}
    if starting:
        actual["dh0"], expected["dh0"] = h0.grad, grads_ref[5][starting]
    assert_close_set(actual, expected, tol, tag)
    return True


def all_cases(rank, world, algorithm):
    for i, cu in enumerate(CASES.values()):
        H, HV = (2, 4) if i % 2 else (2, 2)          # grouped value heads in every other case
        check_case(rank, world, cu, algorithm, torch.float64, H, HV, 1e-9, seed=i, chunk_size=8)
    # fp32 at the product tolerance
    check_case(rank, world, CASES["three_crossings"], algorithm, torch.float32, 1, 2, 1e-5, seed=99,
               chunk_size=16)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algorithm", ["relay", "allgather"])
def test_cp_gated_delta_rule_matches_single_process(world, algorithm):
    assert all(CP_CASES(("chunk", world, algorithm)))


def triton_cases(rank, world, algorithm):
    """The fused kernels (Triton's interpreter on CPU, fp32) under both CP algorithms."""
    for i, name in enumerate(["one_doc_all_ranks", "two_crossings", "tiny_docs"]):
        check_case(rank, world, CASES[name], algorithm, torch.float32, 2, 2 * (1 + i % 2), 2e-5, seed=50 + i,
                   chunk_size=64, impl="triton")
    # Shards of several chunks: the allgather summary runs several spans and folds them.
    check_case(rank, world, [0, 50, 130 * world], algorithm, torch.float32, 1, 1, 2e-5, seed=60,
               chunk_size=64, impl="triton")
    check_gate_activation_case(rank, world, [0, 5, 70, 96], algorithm)
    return True


def check_gate_activation_case(rank, world, cu, algorithm):
    """Logits and raw q, k in, activated and normalised inside the kernels: the gradients of A_log and
    dt_bias are each rank's share, summed over the ranks here (as the CP gradient reduction does in
    training)."""
    total = cu[-1]
    q, k, v, _, _, _ = gdn_inputs(1, total, 1, 2, 8, 6, dtype=torch.float32, seed=70, requires_grad=False)
    q, k = q * 2.0, k * 3.0
    gen = generator(71)
    a, b = torch.randn(1, total, 2, generator=gen), torch.randn(1, total, 2, generator=gen)
    A_log, dt_bias = torch.rand(2, generator=gen), torch.randn(2, generator=gen) - 3.0
    do = torch.randn(1, total, 2, 6, generator=gen)
    cp = CPContext.build(dist.group.WORLD, torch.tensor(cu), total // world, algorithm)
    s, e = cp.start, cp.end

    def grads(impl, shard):
        leaves = [x.detach()[:, s:e] if shard else x.detach() for x in (q, k, v, a, b)]
        leaves = [x.clone().requires_grad_() for x in leaves + [A_log, dt_bias]]
        where = dict(cp=cp) if shard else dict(cu_seqlens=torch.tensor(cu))
        o, _ = gated_delta_rule(*leaves[:5], impl=impl, chunk_size=64, decay_params=tuple(leaves[5:]),
                                beta_activation="2sigmoid", use_qk_l2norm=True, **where)
        (o * (do[:, s:e] if shard else do)).sum().backward()
        return [o.detach()] + [x.grad for x in leaves]

    expected = grads("chunk", False)
    actual = grads("triton", True)
    cp.finish()
    for p in actual[6:]:
        dist.all_reduce(p)
    tag = f"{algorithm}, rank {rank}"
    assert_close_set({"o": actual[0]}, {"o": expected[0][:, s:e]}, 2e-5, tag)
    names = ["dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"]
    shard_expected = [ref[:, s:e] for ref in expected[1:6]] + expected[6:]   # the shared ones whole
    assert_close_set(dict(zip(names, actual[1:])), dict(zip(names, shard_expected)), 2e-5, tag)


@pytest.mark.parametrize("algorithm", ["relay", "allgather"])
def test_cp_triton_matches_single_process(algorithm):
    """Four ranks: the first only sends, the last only receives, the middle ones both (two ranks add
    nothing the kernels' path could get wrong; the PyTorch path runs both worlds above)."""
    assert all(CP_CASES(("triton", 4, algorithm)))


def autocast_allgather_case(rank, world):
    """A model step under bf16 autocast with the allgather algorithm: the summaries are composed in
    fp32 on every rank. Ranks whose last document starts on them run one product more than a rank
    lying inside a document, so under autocast their summaries came out in another dtype and the
    all-gather aborted (gloo: 12288 vs 6144 bytes)."""
    from gdn_parallel.model import HybridLM
    from gdn_parallel.parallel.batch import cp_loss, shard_batch
    from tests.parallel.batches import make_batch
    from tests.parallel.test_layouts import model_config

    seed_torch(0)
    model = HybridLM(model_config())
    for cu in ([0, 5, 48], [0, 20, 30, 48], [0, 48]):
        shard = shard_batch(make_batch(cu, seed=1), rank, world, dist.group.WORLD, "allgather")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cp_loss(model, shard)
        loss.backward()
        shard.context.finish()
        assert torch.isfinite(loss), cu
    return True


def test_allgather_under_autocast_keeps_one_summary_dtype():
    assert all(CP_CASES("autocast"))


# Cases run in launches shared by world size across the modules (tests/parallel/launcher.py, SharedLaunch).
CP_CASES = SharedLaunch({
    **{("chunk", world, algorithm): (world, all_cases, algorithm)
       for world in (2, 4) for algorithm in ("relay", "allgather")},
    **{("triton", 4, algorithm): (4, triton_cases, algorithm) for algorithm in ("relay", "allgather")},
    "autocast": (2, autocast_allgather_case)})
