"""Activation offload (parallel/offload.py) holds full checkpointing's block inputs in host memory and
changes nothing else: losses and every gradient as plain training, alone and under context
parallelism; the inputs come back one block ahead of the backward."""
import copy

import pytest
import torch

from gdn_parallel.config import ConfigError, TrainConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing
from gdn_parallel.parallel.offload import BlockInputOffload
from tests.compare import assert_close_set
from tests.parallel.batches import cp_step, make_batch
from tests.parallel.launcher import run_workers
from tests.parallel.test_cp_model import TOTAL, model_config
from tests.seeds import seed_torch

LAYOUTS = [[0, TOTAL], [0, 5, 19, 20, 40, TOTAL]]


def three_models(offload_blocks=0):
    """Plain, fully checkpointed, and checkpointed with offloaded inputs: the same fp32 weights."""
    seed_torch(0)
    plain = HybridLM(model_config(5)).float()
    checkpointed, offloaded = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, "full")
    offload = BlockInputOffload(torch.device("cpu"))
    apply_activation_checkpointing(offloaded, "full", offload, offload_blocks)
    return plain, checkpointed, offloaded, offload


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same_grads(model, other, context):
    """Bit for bit: an exact copy to the host and back changes no arithmetic."""
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a.grad, b.grad), f"{name}: {context}"


@pytest.mark.parametrize("offload_blocks", [0, 2])
def test_offloaded_training_equals_plain(offload_blocks):
    plain, checkpointed, offloaded, offload = three_models(offload_blocks)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
                  for m in (plain, checkpointed, offloaded)]
    held = len(offloaded.layers) if offload_blocks == 0 else offload_blocks
    for step, cu in enumerate(LAYOUTS):
        batch = make_batch(cu, seed=step)
        losses = []
        offload.reset_counters()
        for model in (plain, checkpointed, offloaded):
            out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
            out.loss.backward()
            losses.append(out.loss.detach())
        # every held block input went to the host and came back, all but the first asked-for one
        # (the last block's) started ahead of its block's backward
        row_bytes = TOTAL * model_config(5).hidden_size * 4
        assert offload.offloaded_bytes == held * row_bytes
        assert (offload.fetched_ahead, offload.fetched_on_demand) == (held - 1, 1)
        assert torch.equal(losses[2], losses[1]), f"step {step}: an exact copy changes nothing"
        assert_same_grads(offloaded, checkpointed, f"offloaded vs checkpointed, step {step}")
        torch.testing.assert_close(losses[2], losses[0], rtol=1e-6, atol=0)
        assert_close_set(grads(offloaded), grads(plain), 1e-6, f"offloaded vs plain, step {step}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert offload.pool.bytes == held * row_bytes, "host buffers are reused from step to step"


def test_no_offload_without_a_backward():
    _, _, offloaded, offload = three_models()
    with torch.no_grad():
        offloaded(make_batch(LAYOUTS[1], seed=1).input_ids)
    assert offload.offloaded_bytes == 0
    out = offloaded(make_batch(LAYOUTS[1], seed=1).input_ids)   # a graph dropped without its backward
    del out
    assert sum(len(free) for free in offload.pool.free.values()) == len(offloaded.layers)


def test_offload_needs_full_checkpointing():
    with pytest.raises(ConfigError, match="train.activation_checkpointing=full"):
        TrainConfig(activation_offload="cpu", activation_checkpointing="selective").validate()
    TrainConfig(activation_offload="cpu", activation_checkpointing="full").validate()
    with pytest.raises(ValueError, match="use 'full'"):
        apply_activation_checkpointing(HybridLM(model_config(5)), "selective", BlockInputOffload("cpu"))


def cp_equal(rank, world):
    """cp = 2, relay: checkpointed and offloaded shards give the single process's loss and gradients."""
    plain, checkpointed, offloaded, offload = three_models()
    for step, cu in enumerate(LAYOUTS):
        batch = make_batch(cu, seed=step)
        out = plain(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()
        totals = [cp_step(model, batch, rank, world) for model in (checkpointed, offloaded)]
        tag = f"cp={world} rank={rank} step={step}"
        assert torch.equal(totals[1], totals[0]), tag
        assert_same_grads(offloaded, checkpointed, f"offloaded vs checkpointed, {tag}")
        torch.testing.assert_close(totals[1], out.loss.detach(), rtol=1e-6, atol=0)
        assert_close_set(grads(offloaded), grads(plain), 1e-6, f"offloaded vs one process, {tag}")
        assert offload.offloaded_bytes > 0
        for model in (plain, checkpointed, offloaded):
            model.zero_grad()
    return True


def test_offload_under_context_parallelism():
    assert all(run_workers(cp_equal, 2))


def test_page_locked_buffers_are_unregistered_before_they_are_freed(monkeypatch):
    """A pool's registered host buffers are unregistered when the pool is collected, or by release(),
    before they are freed (freed while registered, their addresses stay registered in the driver
    and a later tensor there fails its copies to the GPU). CUDA's runtime is faked: the calls are counted."""
    import gc

    from gdn_parallel.parallel import offload as offload_module
    calls: list[tuple[str, int]] = []

    class FakeRuntime:
        def cudaHostRegister(self, pointer, nbytes, flags):
            calls.append(("register", pointer))
            return 0

        def cudaHostUnregister(self, pointer):
            calls.append(("unregister", pointer))
            return 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeRuntime())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def take(pool, numel):
        return pool.take(numel, torch.float32)

    pool = offload_module._HostPool(pin=True)
    pointers = [take(pool, 1 << 16).data_ptr(), take(pool, 1 << 17).data_ptr()]
    pool.release()
    assert sorted(p for kind, p in calls if kind == "unregister") == sorted(pointers)
    calls.clear()
    later = take(pool, 1 << 18).data_ptr()   # a buffer taken after release(): unregistered at the pool's end
    del pool
    gc.collect()
    assert calls == [("register", later), ("unregister", later)]


def test_page_locked_buffers_are_whole_zeroed_and_registered_at_their_size(monkeypatch):
    """The pool's page-locked path (huge pages, written on several threads before registering) gives a
    buffer of the exact size and dtype, zeroed, writable, and registered from its first byte to its last."""
    from gdn_parallel.parallel import offload as offload_module
    registered = []

    class FakeRuntime:
        def cudaHostRegister(self, pointer, nbytes, flags):
            registered.append((pointer, nbytes))
            return 0

        def cudaHostUnregister(self, pointer):
            return 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeRuntime())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    pool = offload_module._HostPool(pin=True)
    for numel, dtype in ((3 << 20, torch.float32), (12345, torch.bfloat16), (1, torch.float32)):
        buffer = pool.take(numel, dtype)
        assert (buffer.numel(), buffer.dtype) == (numel, dtype)
        assert registered[-1] == (buffer.data_ptr(), numel * buffer.element_size())
        assert not buffer.any()
        buffer.fill_(2)
        assert (buffer == 2).all()
    pool.release()
