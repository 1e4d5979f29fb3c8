"""The training step reads no device values on the host (issue 26). On a GPU every such read (.item(),
.tolist(), bool(), a copy to the host) waits for all queued kernels and leaves the GPU idle while the
host catches up. Here the token tensors of a batch stand for GPU tensors: a tensor subclass whose
values cannot be read on the host, and which every op on them passes on. The document boundaries stay
plain host tensors, as PackedBatch.to keeps them. A forward, backward and clipping of the trainer's
ParallelModel over a GDN + sliding-window + full-attention model goes through without a read, with
the loss and gradients of plain tensors. (The GPU's own kernels: tests/kernels/test_no_sync_gpu.py.)"""
import copy
import sys

import pytest
import torch
import torch.distributed as dist

from gdn_parallel.config import IGNORE_INDEX, ParallelConfig
from gdn_parallel.data.packing import PackedBatch, packed_batches
from gdn_parallel.model import HybridLM
from gdn_parallel.ops import validation
from gdn_parallel.parallel.mesh import build_mesh
from gdn_parallel.parallel.parallelize import parallelize
from tests.compare import assert_close_set
from tests.parallel.test_layouts import model_config
from tests.seeds import generator, seed_torch

HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__", "cpu",
              "nonzero", "masked_select", "unique"}  # the last three: output shapes the host must read


class OnDevice(torch.Tensor):
    """Stands for a tensor on a GPU: reading its values on the host fails the test."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "to" and _to_host(args[1:], kwargs)):
            raise AssertionError(f"the host read device values: Tensor.{name}")
        return super().__torch_function__(func, types, args, kwargs)


def _to_host(args, kwargs) -> bool:
    """`.to("cpu")`: the host named as such. (A torch.device target is taken to be another tensor's
    device, e.g. `x.device`, which the stand-ins share with the CPU tensors here.)"""
    return any(t == "cpu" for t in (*args, kwargs.get("device")) if isinstance(t, str))


def on_device(batch: PackedBatch) -> PackedBatch:
    moved = batch.to("cpu")  # what the trainer does with a GPU: counts labels, keeps cu_seqlens
    tokens = (moved.input_ids, moved.labels, moved.position_ids)
    stand_in = PackedBatch(*(t.as_subclass(OnDevice) for t in tokens), moved.cu_seqlens)
    stand_in.known_label_count = moved.known_label_count
    return stand_in


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_mesh(ParallelConfig(), "cpu")
    dist.destroy_process_group()


@pytest.fixture
def checks_as_on_a_gpu(monkeypatch):
    """The checks that read values run only on the CPU (validation.values_checked): off here, as on a
    GPU, for the stand-ins."""
    def checked(x):
        return not isinstance(x, OnDevice) and x.device.type == "cpu"
    for module in list(sys.modules.values()):
        if getattr(module, "values_checked", None) is validation.values_checked:
            monkeypatch.setattr(module, "values_checked", checked)


def test_a_training_step_reads_no_device_value(group_of_one, checks_as_on_a_gpu):
    seed_torch(0)
    model = HybridLM(model_config())
    gen = generator(3)
    lengths = torch.randint(5, 40, (12,), generator=gen)
    documents = [torch.randint(0, 64, (int(n),), generator=gen) for n in lengths]
    rows = [next(packed_batches(documents, 24, 2, seed=4)) for _ in range(2)]
    results = []
    for wrap in (lambda row: row.to("cpu"), on_device):
        parallel = parallelize(copy.deepcopy(model), group_of_one)
        batches = [wrap(row) for row in rows]
        assert all(b.cu_seqlens.device.type == "cpu" and type(b.cu_seqlens) is torch.Tensor for b in batches)
        loss = parallel.train_step(batches)
        grad_norm = parallel.clip_grad_norm(1.0)
        grads = {name: p.grad.as_subclass(torch.Tensor).clone()
                 for name, p in parallel.model.named_parameters()}
        results.append((loss.as_subclass(torch.Tensor), grad_norm.as_subclass(torch.Tensor), grads))
    (loss, norm, grads), (loss_d, norm_d, grads_d) = results
    assert_close_set({"loss": loss_d, "grad_norm": norm_d, **grads_d},
                     {"loss": loss, "grad_norm": norm, **grads}, 1e-6, "stand-ins for device tensors")


def test_the_stand_in_catches_reads():
    x = torch.arange(4).as_subclass(OnDevice)
    for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x[0]), lambda: x.to("cpu"),
                 lambda: int((x != IGNORE_INDEX).sum())):
        with pytest.raises(AssertionError, match="host read device values"):
            read()
    assert isinstance(x * 2, OnDevice) and isinstance(x.to(torch.float32), OnDevice)


def test_moved_batches_keep_boundaries_and_their_label_count():
    gen = generator(5)
    documents = [torch.randint(0, 64, (int(n),), generator=gen) for n in (9, 30, 4)]
    batch = next(packed_batches(documents, 16, 2, seed=1))
    moved = batch.to("meta")  # any device: the tokens go, the boundaries stay
    assert moved.input_ids.device.type == "meta" and moved.cu_seqlens is batch.cu_seqlens
    assert moved.label_count() == int((batch.labels != IGNORE_INDEX).sum()) == batch.num_label_tokens
    import dataclasses
    relabelled = dataclasses.replace(batch, labels=torch.full_like(batch.labels, IGNORE_INDEX))
    assert relabelled.label_count() == 0  # replace() does not carry the old count


def test_document_bookkeeping_checks_host_boundaries_before_placing_them():
    """Boundaries on the host, results on another device ("meta": its values cannot be read back,
    as a GPU's would be read only through a sync): checked once on the host, then placed."""
    from gdn_parallel.ops.rope import document_ids_from_cu_seqlens, positions_from_cu_seqlens
    cu = torch.tensor([0, 3, 8])
    for fn in (document_ids_from_cu_seqlens, positions_from_cu_seqlens):
        placed = fn(cu, 8, device="meta")
        assert placed.device.type == "meta" and placed.shape == (8,)
    assert positions_from_cu_seqlens(cu, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
