"""Activation checkpointing recomputes each block in the backward and changes nothing else."""
import copy

import pytest
import torch

from gdn_parallel.config import ConfigError, TrainConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing
from tests.parallel.batches import make_batch
from tests.parallel.launcher import SharedLaunch
from tests.parallel.test_layouts import model_config
from tests.seeds import seed_torch


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_blocks_are_recomputed_and_gradients_are_unchanged(mode):
    """full recomputes whole blocks, selective the MLP branch only; the gradients are the same."""
    seed_torch(0)
    plain = HybridLM(model_config()).double()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, mode) == len(wrapped.layers)
    mlp_calls, mixer_calls = [], []
    for block in wrapped.layers:
        block.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
        block.attn.register_forward_pre_hook(lambda *_: mixer_calls.append(1))
    batch = make_batch([0, 5, 19, 20, 40, 48], seed=3)
    losses = []
    for model in (plain, wrapped):
        out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()
        losses.append(out.loss.item())
    assert len(mlp_calls) == 2 * len(wrapped.layers)          # forward + recompute
    assert len(mixer_calls) == (2 if mode == "full" else 1) * len(wrapped.layers)
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]


def test_no_recompute_without_grad_and_bad_mode_is_named():
    model = HybridLM(model_config()).double()
    apply_activation_checkpointing(model, "full")
    with torch.no_grad():
        model(make_batch([0, 48], seed=1).input_ids)
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        apply_activation_checkpointing(model, "some")
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        TrainConfig(activation_checkpointing="blocks").validate()


def count_messages(rank, world, algorithm):
    """One CP training step with and without checkpointing: the recomputation replays what the first
    forward received, so the messages sent (and all-gathers run) are the same in number."""
    import torch.distributed as dist

    from gdn_parallel.comm import links
    from gdn_parallel.config import ParallelConfig
    from gdn_parallel.parallel.mesh import build_mesh
    from gdn_parallel.parallel.parallelize import parallelize

    counts = {}
    # every hand-over goes through comm.links (its P2P ops), the all-gathers through torch
    for module, name in ((links, "isend"), (links, "irecv"), (dist, "all_gather")):
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)
        setattr(module, name, counted)
    config = ParallelConfig(cp=2, cp_algorithm=algorithm)
    dims = build_mesh(config, "cpu")
    seen, grads = [], []
    for mode in ("none", "full"):
        seed_torch(0)
        model = parallelize(HybridLM(model_config()).double(), dims, config, activation_checkpointing=mode)
        counts.clear()
        model.train_step([make_batch([0, 5, 30, 48], seed=7)])
        seen.append(dict(counts))
        grads.append([p.grad.clone() for _, p in model.named_parameters()])
    assert seen[0] == seen[1] and seen[0], f"rank {rank} {algorithm}: messages {seen}"
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    return True


@pytest.mark.parametrize("algorithm", ["relay", "allgather"])
def test_recomputed_blocks_do_not_communicate_again(algorithm):
    assert all(CP_CHECKS(("messages", algorithm)))


def sends_own_their_bytes(rank, world, algorithm):
    """Every tensor handed to isend owns exactly its bytes. A send is held until the step's sends are
    finished; one that viewed a larger storage (a conv halo is the last rows of the whole conv
    input) kept that storage alive past the checkpointed forward: every layer's conv inputs on the
    first CP rank, +10 GB at 64K tokens per rank on an H200."""
    from gdn_parallel.comm import links
    from gdn_parallel.config import ParallelConfig
    from gdn_parallel.parallel.mesh import build_mesh
    from gdn_parallel.parallel.parallelize import parallelize

    sends = []
    original = links.isend   # every hand-over's send

    def recorded(tensor, *args, **kwargs):
        sends.append((tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes()))
        return original(tensor, *args, **kwargs)
    links.isend = recorded
    config = ParallelConfig(cp=2, cp_algorithm=algorithm)
    seed_torch(0)
    model = parallelize(HybridLM(model_config()).double(), build_mesh(config, "cpu"), config,
                        activation_checkpointing="full")
    model.train_step([make_batch([0, 5, 30, 48], seed=7)])
    assert sends, f"rank {rank}: no sends recorded"
    pinned = [(size, storage) for size, storage in sends if size != storage]
    assert not pinned, \
        f"rank {rank} {algorithm}: sends holding larger storages (bytes, storage bytes) {pinned}"
    return True


@pytest.mark.parametrize("algorithm", ["relay", "allgather"])
def test_sends_do_not_hold_the_tensors_they_slice(algorithm):
    assert all(CP_CHECKS(("sends", algorithm)))


# The four 2-process cases above in one launch (tests/parallel/launcher.py, SharedLaunch). Each case
# wraps comm.links' functions in its processes; a wrapper left by the case before passes every call
# through, so the counts and sizes each case reads are its own.
CP_CHECKS = SharedLaunch({(kind, algorithm): (2, check, algorithm)
                          for kind, check in (("messages", count_messages), ("sends", sends_own_their_bytes))
                          for algorithm in ("relay", "allgather")})
