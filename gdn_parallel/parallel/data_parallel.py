"""Data parallelism over dp (and the gradient reduction over dp x cp), applied from outside
(docs/design.md §3).

`apply_data_parallel(module, dims, config)` wraps a whole HybridLM or a pipeline-stage module (its
blocks in `module.layers`, an nn.ModuleList or nn.ModuleDict):

- `fsdp`: FSDP2 `fully_shard` on every block, then on the root. Parameters are sharded over dp and
  replicated over cp (HSDP on a (cp, dp) mesh; a 1-D dp mesh when cp == 1), so the forward's
  parameter all-gathers stay inside dp and never couple the CP wavefront; gradients are
  reduce-scattered over dp and all-reduced over cp in the backward. With
  `parallel.fsdp_reshard_after_forward=false` a block keeps its gathered parameters from its first
  forward of a step to its last micro-batch's backward (ParallelModel switches the reshard after each
  backward off until then; torch's pipeline schedule does the same for its stages).
- `ddp`: torch DDP over the flattened dp x cp group; its bucketed all-reduces are asynchronous and
  overlap the backward. Nothing is communicated in the forward (`broadcast_buffers=False`).

Gradient contract (both): after backward every rank holds the SUM over the dp x cp ranks of the
per-rank gradients. Each rank's loss is its summed token loss divided by the global label count over
all dp and cp ranks, so the sum is exactly the single-device gradient of the global mean loss.
FSDP2 and DDP average by default; here FSDP2 gets `set_gradient_divide_factor(1.0)` plus
`set_force_sum_reduction_for_comms(True)` (plain SUM collectives: no PreMulSum, which gloo rejects
and NCCL mishandles for bf16), and DDP gets a comm hook that all-reduces each bucket with SUM and
does not divide. Scaling the loss by the group size instead would make the loss value depend on the
layout and the reported loss wrong; the divide factor costs nothing.

`clip_grad_norm` takes the global L2 norm over every mesh dimension; `global_label_count` sums a
label count over the dp replicas.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ParallelConfig
from ..model import blocks_of
from .mesh import ParallelDims
from .tensor import tp_shard_dim

__all__ = ["apply_data_parallel", "clip_grad_norm", "global_label_count", "global_label_normalizer",
           "hsdp_mesh"]


# ---------------------------------------------------------------- meshes and blocks
def hsdp_mesh(dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP2 shards over: (cp, dp) = (replicate, shard), or the 1-D dp mesh when cp == 1.

    DeviceMesh slicing only keeps the parent's dimension order (`mesh["cp", "dp"]` raises
    "Mesh dim indices should be in ascending order" because the mesh is pp x dp x cp x tp), so the
    transposed 2-D mesh is assembled from the existing cp and dp groups with
    `DeviceMesh.from_group`: no new communicator is created.
    """
    if dims.config.cp == 1:
        return dims.mesh["dp"]
    mesh = dims.mesh
    names = mesh.mesh_dim_names
    coord = mesh.get_coordinate()
    if names is None or coord is None:
        raise ValueError("hsdp_mesh needs a mesh with named dims that holds this rank (build_mesh's)")
    index = tuple(slice(None) if name in ("dp", "cp") else coord[i] for i, name in enumerate(names))
    ranks = mesh.mesh[index]                       # pp and tp fixed at this rank's place
    if names.index("dp") < names.index("cp"):      # [dp, cp] -> [cp, dp]
        ranks = ranks.transpose(0, 1)
    ranks = ranks.contiguous()
    return DeviceMesh.from_group([mesh.get_group("cp"), mesh.get_group("dp")], mesh.device_type,
                                 mesh=ranks, mesh_dim_names=("cp", "dp"))


def _param_attributes(module: nn.Module) -> dict:
    return {name: dict(p.__dict__) for name, p in module.named_parameters() if p.__dict__}


def _restore_param_attributes(module: nn.Module, attributes: dict) -> None:
    for name, p in module.named_parameters():
        for key, value in attributes.get(name, {}).items():
            setattr(p, key, value)


# ---------------------------------------------------------------- wrapping
def apply_data_parallel(module: nn.Module, dims: ParallelDims, config: ParallelConfig | None = None,
                        param_dtype: torch.dtype | None = None,
                        reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Apply `config.data_parallel` ('fsdp' | 'ddp') over dp (x cp) and return the module to train.

    fsdp returns `module` itself (now an FSDPModule); ddp returns a DistributedDataParallel wrapper
    (the model is `.module`). `param_dtype` (e.g. bf16 on GPU) turns on mixed precision: FSDP2
    all-gathers parameters in it and reduces gradients in `reduce_dtype`; DDP does not cast
    parameters (use torch.autocast for the compute) but reduces gradients in `reduce_dtype`.
    Without `param_dtype` gradients are reduced in their own dtype.
    """
    config = config or dims.config
    if config.data_parallel == "fsdp":
        return _apply_fsdp(module, dims, param_dtype, reduce_dtype, config.fsdp_reshard_after_forward)
    if config.data_parallel == "ddp":
        return _apply_ddp(module, dims, reduce_dtype if param_dtype is not None else None)
    raise ValueError(f"parallel.data_parallel={config.data_parallel!r}; choose 'fsdp' or 'ddp'")


def _apply_fsdp(module, dims, param_dtype, reduce_dtype, reshard_after_forward: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = hsdp_mesh(dims)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if param_dtype is not None:
        # cast_forward_inputs=False: FSDP2 would rebuild every dataclass in the inputs on each
        # wrapped module (dataclasses.replace), copying SequenceInfo -> CPContext -> its outbox
        # of in-flight isends, so the sends would be tracked in a copy nobody waits on.
        # Nothing needs the cast: hidden states come out of the bf16 embedding already in bf16.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   cast_forward_inputs=False)
    attributes = _param_attributes(module)     # fully_shard makes new Parameter objects
    wrapped = [fully_shard(block, **kwargs) for block in blocks_of(module)]
    wrapped.append(fully_shard(module, **kwargs))
    for m in wrapped:
        m.set_gradient_divide_factor(1.0)          # SUM over dp x cp, no averaging
        m.set_force_sum_reduction_for_comms(True)  # plain ReduceOp.SUM (gloo has no PreMulSum)
    _restore_param_attributes(module, attributes)
    return module


def _sum_allreduce_hook(state, bucket):
    """DDP comm hook: all-reduce the bucket with SUM (the default hook divides by the group size),
    in `reduce_dtype` when one is given; asynchronous like the default.

    The future it returns must carry the collectives' completion to whoever reads the bucket. An
    NCCL future completes when its collective is queued, and its value is ready only on a stream
    that waited for it (`Future.wait()` inside a callback makes the callback's stream wait, without
    blocking the host); a future made by `torch.futures.collect_all` is a plain CPU future that
    knows no streams, so DDP copied the buckets into the gradients while NCCL was still summing them
    (dp2 ddp on 2 H100s: gradients off by 0.7-1.0 relative; gloo's futures complete when the sum is
    done, so CPU runs never saw it). So the result is chained from the collectives' own futures, and
    the callback waits on each of them.

    Over more than two ranks each parameter's gradient is reduced on its own. DDP rebuilds its
    buckets after its first step (in the order gradients became ready), so a resumed run's first
    step has other buckets than the uninterrupted run's; an all-reduce's summation order over 3+
    ranks depends on where an element sits in the buffer, so whole-bucket reductions made the
    resumed run differ in the last bits (seen at dp2 x cp2). Per parameter, the order depends on
    the parameter alone: a resume is bit for bit. Two ranks add two numbers, in any order the same."""
    group, reduce_dtype = state
    buffer = bucket.buffer()
    # Views of the buffer, one per gradient (in the buffer's order); any split of it sums correctly.
    pieces = ([buffer] if dist.get_world_size(group) <= 2
              else list(torch.split(buffer, [g.numel() for g in bucket.gradients()])))
    sends = [p if reduce_dtype is None or reduce_dtype == p.dtype else p.to(reduce_dtype) for p in pieces]
    futures = [dist.all_reduce(send, group=group, async_op=True).get_future() for send in sends]

    def reduced(_last):
        for future in futures:   # CUDA: this stream waits for each collective; CPU: already done
            future.wait()
        for piece, send in zip(pieces, sends):
            if send is not piece:  # reduced in reduce_dtype
                piece.copy_(send)
        return buffer

    return futures[-1].then(reduced)


def _apply_ddp(module, dims, reduce_dtype):
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dims.dp_cp_mesh.get_group()
    # device_ids=None: DDP leaves the inputs alone (no recursive copy of SequenceInfo/CPContext).
    # No buffer broadcast in the forward (a collective over dp x cp; buffers are not trained):
    # `forward_sync_buffers=False` where it exists (torch >= 2.13), `broadcast_buffers=False` before.
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
               else {"broadcast_buffers": False})
    ddp = DDP(module, device_ids=None, process_group=group, **no_sync)
    ddp.register_comm_hook((group, reduce_dtype), _sum_allreduce_hook)
    return ddp


# ---------------------------------------------------------------- norms and counts
def _mesh_device(dims: ParallelDims) -> torch.device:
    """This rank's device of the mesh's type (for small collective buffers)."""
    if dims.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dims.mesh.device_type)


def _group(dims: ParallelDims, name: str):
    names = dims.mesh.mesh_dim_names
    if names is None:
        raise ValueError("the mesh's dims are not named (build it with build_mesh)")
    return dims.group(name) if dims.mesh.size(names.index(name)) > 1 else None


@torch.no_grad()
def clip_grad_norm(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                   dims: ParallelDims) -> torch.Tensor:
    """Global L2 gradient norm over pp x dp x cp x tp; grads are scaled by max_norm / (norm + 1e-6)
    clamped to 1, as torch.nn.utils.clip_grad_norm_ does (no host sync). Returns the norm (a tensor).

    FSDP2 gradients are DTensors sharded over dp: squared norms of the local shards sum over their
    Shard mesh dims (replicated mesh dims, cp under HSDP, count once). Parameters marked
    `_tp_shard_dim` hold different slices per tp rank: summed over tp; unmarked parameters are
    replicated over tp: counted once. Pipeline stages hold disjoint parameters: summed over pp.
    cp replicas hold identical gradients after the reduction: counted once.
    A collective over the whole mesh: every rank must call it (with its own stage's parameters).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]   # the same, typed as not None
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device if grads else _mesh_device(dims)
    groups, meshes = _gradient_groups(params)
    totals = torch.zeros(2, dtype=acc, device=device)   # [replicated over tp, sharded over tp]
    for shard_key, entry in _squared_sums(groups, acc, device).items():
        if shard_key is not None:
            mesh = meshes[shard_key]
            for i in shard_key[1]:
                dist.all_reduce(entry, group=mesh.get_group(i))
        totals += entry
    replicated, sharded = totals[0], totals[1].clone()
    tp_group = _group(dims, "tp")
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    total = replicated + sharded
    pp_group = _group(dims, "pp")
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total_norm = total.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for (_, _, dev, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device=dev, dtype=dtype))
    return total_norm


def _gradient_groups(params: list) -> tuple[dict, dict]:
    """The local gradients grouped by (the DTensor mesh dims their squares sum over, sharded over
    tp?, device, dtype), and the mesh of each such sharding. Insertion order is the parameter
    order, the same on every rank of a dp group, so the reductions that follow pair up."""
    from torch.distributed.tensor import DTensor, Shard

    groups: dict = {}
    meshes: dict = {}
    for p in params:
        g, shard_key = p.grad, None
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            sharded = tuple(i for i, placement in enumerate(g.placements)
                            if isinstance(placement, Shard) and mesh.size(i) > 1)
            if sharded:
                shard_key = (mesh.mesh_dim_names, sharded)
                meshes.setdefault(shard_key, mesh)
            g = g.to_local()
        tp_sharded = tp_shard_dim(p) is not None
        groups.setdefault((shard_key, tp_sharded, g.device, g.dtype), []).append(g)
    return groups, meshes


def _squared_sums(groups: dict, acc: torch.dtype, device: torch.device) -> dict:
    """Per DTensor sharding: this rank's [replicated over tp, sharded over tp] squared norms."""
    sums: dict = {}
    for (shard_key, tp_sharded, _, _), grads in groups.items():
        nonempty = [g for g in grads if g.numel()]
        if not nonempty:
            continue
        norms = torch._foreach_norm(nonempty, 2, dtype=acc)
        entry = sums.setdefault(shard_key, torch.zeros(2, dtype=acc, device=device))
        entry[int(tp_sharded)] += torch.stack(norms).to(device).square().sum()
    return sums


def global_label_normalizer(local_count: int, dims: ParallelDims) -> int | torch.Tensor:
    """The divisor of a training step's summed loss: the labels over the dp replicas, at least 1. With
    dp = 1 the host's number; over several replicas a 0-d tensor on the mesh's device, all-reduced
    there and never read on the host (on a GPU the read would wait for the previous step's kernels,
    and the next step's first launches for the read)."""
    if dims.config.dp == 1:
        return max(int(local_count), 1)
    # a fill kernel: a copy from pageable host memory would wait for the device too
    count = torch.full((), int(local_count), dtype=torch.int64, device=_mesh_device(dims))
    dist.all_reduce(count, group=dims.group("dp"))
    return count.clamp_min(1)


def global_label_count(local_count: int | torch.Tensor, dims: ParallelDims) -> int:
    """Sum a row's label count over the dp replicas. The cp shards of one row already know the
    row's count (`shard_batch` counts the whole row), so this reduces over dp only."""
    if dims.config.dp == 1:
        return int(local_count)
    count = torch.as_tensor(local_count, dtype=torch.int64).reshape(1).to(_mesh_device(dims))
    dist.all_reduce(count, group=dims.group("dp"))
    return int(count.item())
