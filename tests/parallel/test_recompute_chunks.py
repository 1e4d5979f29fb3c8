"""Chunked recomputation (train.recompute_chunks, parallel/checkpointing.py): each block runs in
sequence chunks, each its own checkpoint, the GDN state and the conv and sliding-window halos handed
from chunk to chunk as between context-parallel ranks. Training is unchanged: losses and every
gradient as plain training, alone, with offload, and under cp = 2: in fp64 to 1e-9 (equal in exact
arithmetic), in fp32 to 1e-6 over all gradients together and 1e-5 for each (the chunks sum in
another order, and the smallest gradients differ by rounding at 1e-6 of their own size)."""
import copy

import pytest
import torch

from gdn_parallel.config import Config, ConfigError, ModelConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing
from gdn_parallel.parallel.offload import BlockInputOffload
from tests.compare import assert_close_set, rel_err
from tests.parallel.batches import cp_step, make_batch
from tests.parallel.launcher import run_workers
from tests.seeds import seed_torch

TOTAL = 48
# documents crossing the chunk boundaries, one ending on one, one of a single token
LAYOUTS = [[0, TOTAL], [0, 5, 19, 20, 40, TOTAL], [0, 12, 13, 36, TOTAL]]


def model_config(window: int, impl: str = "chunk") -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, n_layers=4, layer_pattern="GS", gdn_num_heads=2,
                       gdn_num_v_heads=4, gdn_head_dim=16, attn_num_heads=4, attn_num_kv_heads=2,
                       window_size=window, gdn_chunk_size=64 if impl == "triton" else 8,
                       intermediate_size=48, gdn_impl=impl)


def plain_and_chunked(config: ModelConfig, chunks: int, offload=None, dtype=torch.float32):
    seed_torch(0)
    plain = HybridLM(config).to(dtype)
    chunked = copy.deepcopy(plain)
    apply_activation_checkpointing(chunked, "full", offload, 0, chunks)
    return plain, chunked


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same_training(losses, chunked, plain, context):
    if losses[0].dtype == torch.float64:
        assert rel_err(losses[1], losses[0]) < 1e-12, (context, losses)
        assert_close_set(grads(chunked), grads(plain), 1e-9, context)
        return
    assert rel_err(losses[1], losses[0]) < 1e-6, (context, losses)
    flat = [torch.cat([g.flatten() for g in grads(m).values()]) for m in (chunked, plain)]
    assert rel_err(*flat) < 1e-6, context
    assert_close_set(grads(chunked), grads(plain), 1e-5, context)


def train_both(plain, chunked, steps=LAYOUTS):
    """Each layout's loss and gradients from the same weights (an optimizer step would carry fp32
    rounding differences into the next step's weights)."""
    for step, cu in enumerate(steps):
        batch = make_batch(cu, seed=step)
        losses = []
        for model in (plain, chunked):
            out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert_same_training(losses, chunked, plain, f"step {step} (documents {cu})")
        plain.zero_grad()
        chunked.zero_grad()


# window 5: halos inside one chunk; 30: over several chunks (multi-hop)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("chunks, window", [(2, 5), (4, 5), (4, 30), (3, 30)])
def test_chunked_recomputation_equals_plain_training(chunks, window, dtype):
    plain, chunked = plain_and_chunked(model_config(window), chunks, dtype=dtype)
    recomputed = []
    for block in chunked.layers:
        block.attn.register_forward_pre_hook(lambda _m, args: recomputed.append(args[0].shape[1]))
    train_both(plain, chunked, LAYOUTS[:1])
    # forward and recomputation, each chunk on its own: twice per block and chunk, a chunk's tokens each
    assert recomputed == [TOTAL // chunks] * (2 * chunks * len(chunked.layers))
    train_both(plain, chunked, LAYOUTS[1:])


def test_chunked_triton_kernels_equal_plain_training():
    """The kernels' path (Triton's interpreter on CPU): the state enters as an initial state. One
    block of each kind and two chunks, the second's documents entering from the first (the
    interpreter's time: each chunk is a launch of every kernel)."""
    config = model_config(5, "triton")
    config.n_layers = 2
    plain, chunked = plain_and_chunked(config, 2)
    train_both(plain, chunked, LAYOUTS[1:2])


def test_chunks_with_offloaded_inputs_equal_plain_training():
    offload = BlockInputOffload(torch.device("cpu"))
    plain, chunked = plain_and_chunked(model_config(5), 4, offload)
    train_both(plain, chunked, LAYOUTS[1:])
    assert offload.offloaded_bytes > 0


def test_what_chunks_cannot_take_is_named():
    full = model_config(5)
    full.layer_pattern = "GA"
    with pytest.raises(ValueError, match="full-attention layers"):
        apply_activation_checkpointing(HybridLM(full), "full", chunks=2)
    with pytest.raises(ValueError, match="needs activation_checkpointing='full'"):
        apply_activation_checkpointing(HybridLM(model_config(5)), "selective", chunks=2)
    tiny = "configs/tiny-cpu.yaml"
    for overrides, field in [(["train.recompute_chunks=2"], "train.activation_checkpointing=full"),
                             (["train.activation_checkpointing=full", "train.recompute_chunks=3"],
                              "train.recompute_chunks"),
                             (["train.activation_checkpointing=full", "train.recompute_chunks=2",
                               "parallel.cp_algorithm=allgather"], "parallel.cp_algorithm"),
                             (["train.recompute_chunks=0"], "train.recompute_chunks")]:
        with pytest.raises(ConfigError, match=field):
            Config.from_yaml(tiny, overrides)
    with torch.no_grad():   # evaluation runs whole blocks
        _, chunked = plain_and_chunked(model_config(5), 4)
        chunked(make_batch(LAYOUTS[1], seed=0).input_ids, cu_seqlens=torch.tensor(LAYOUTS[1]))


def cp_equal(rank, world):
    """cp = 2 ranks x 2 chunks each: the shards' loss and gradients are the single process's."""
    plain, chunked = plain_and_chunked(model_config(30), 2, dtype=torch.float64)
    for step, cu in enumerate(LAYOUTS):
        batch = make_batch(cu, seed=step)
        out = plain(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()
        total = cp_step(chunked, batch, rank, world)
        assert_same_training([out.loss.detach(), total], chunked, plain,
                             f"cp={world} x 2 chunks, rank {rank}, step {step}")
        plain.zero_grad()
        chunked.zero_grad()
    return True


def test_chunks_under_context_parallelism():
    assert all(run_workers(cp_equal, 2))


def test_a_halo_handed_to_the_next_chunk_is_its_own_copy_and_carries_the_gradient():
    """The receiving chunk keeps what it got until its backward: a view would keep the sender's whole
    tensor alive (the conv's and attention's halos are the last tokens of a chunk's projections)."""
    from gdn_parallel.comm.context import CPContext, Loopback
    from gdn_parallel.comm.p2p import post_recv_from_prev, send_to_next
    loopback = Loopback()
    first, second = (CPContext(None, k, 2, [0, 8], 4, chunks=2, loopback=loopback) for k in range(2))
    x = torch.randn(1, 4, 3, requires_grad=True)
    assert send_to_next(first, x[:, 2:]) is None
    halo = post_recv_from_prev(second, (1, 2, 3), x.dtype, x.device).wait(x)
    assert halo.untyped_storage().nbytes() == halo.numel() * halo.element_size()
    halo.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 0, 1, 1])[None, :, None].expand(1, 4, 3))
