"""One layout's run, as the trainer sets it up, measured against the reference on every rank.

The rank builds only its pipeline parts (model.build_model with parallel.pipeline.parts_of_rank,
each part from its own seed: the reference's weights), applies the layout with `parallelize`, and
trains the steps: its dp replica's micro-batches through `ParallelModel.train_step`, the global
gradient norm clipped, AdamW. Each step, every gradient it holds (before clipping) and every
parameter (after the update) is gathered to its full single-device shape and compared with the
reference at the same parameters; the reference then steps AdamW with the layout's gathered, clipped
gradients (params: compare.py), and takes the layout's new parameters before the next step (from the
pipeline rank that holds each one). Only per-tensor norms leave the rank (`compare.tensor_diff`).
With --checkpoint, a CheckpointLeg (checkpoint_leg.py) is told of the first two steps and resumes
the second from its checkpoint once the run is done.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config import ModelConfig, ParallelConfig
from ..data.packing import PackedBatch
from ..model import build_model, residual_stream_dtype
from ..parallel.mesh import ParallelDims, build_mesh
from ..parallel.parallelize import parallelize
from ..parallel.pipeline import parts_of_rank
from ..parallel.tensor import full_tensor, tp_shard_dim
from .batches import replica_share
from .checkpoint_leg import CHECKPOINT_FAULTS, SAVED_AFTER, CheckpointLeg, CheckpointSettings, RankCheckpoint
from .compare import TensorDiff, scalar_error, tensor_diff
from .layouts import Layout
from .reference import OptimizerSettings, ReferenceModel, StepGradients, clip_coefficient

FAULT_SCALE = 1.5   # --inject-fault: one gradient (or updated parameter) of the last rank, times this
FAULT_KINDS = ("grads", "params")


@dataclass
class RankMeasurement:
    """What one rank saw of a layout, per step (sent to every rank with all_gather_object)."""
    losses: list[float] = field(default_factory=list)
    scalars: list[dict[str, float]] = field(default_factory=list)                  # loss, grad_norm
    tensors: list[dict[str, dict[str, TensorDiff]]] = field(default_factory=list)  # grads, params
    checkpoint: RankCheckpoint | None = None                                    # --checkpoint


def full_shape(t: torch.Tensor, param: torch.nn.Parameter, dims: ParallelDims) -> torch.Tensor:
    """A parameter or gradient at its single-device shape: FSDP2 shards gathered over dp, tensor-
    parallel slices over tp. A collective over this rank's stage: every rank of it calls it in turn."""
    if tp_shard_dim(param) is not None:
        return full_tensor(t, param, dims.group("tp"))
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def part_of(parameter_name: str) -> str:
    """The model/build.py part a parameter belongs to: `layers.3.mlp.up_proj.weight` -> `layers.3`."""
    head = parameter_name.split(".")
    return ".".join(head[:2]) if head[0] == "layers" else head[0]


def build_layout(layout: Layout, model_config: ModelConfig, seed: int, dims: ParallelDims,
                 device: torch.device, optimizer: OptimizerSettings, seq_len: int,
                 autocast_dtype: torch.dtype | None = None):
    """(parallel model, its trained named parameters, AdamW) of this rank, as the trainer builds them."""
    config = layout.parallel_config()
    parts = parts_of_rank(model_config, config, dims.rank("pp"), seq_len)
    model = build_model(model_config, device, seed, keep=parts.__contains__)
    parallel = parallelize(model, dims, config, device=device, seq_len=seq_len,
                           activation_checkpointing=layout.activation_checkpointing,
                           activation_offload=layout.activation_offload,
                           stream_dtype=residual_stream_dtype(model_config, autocast_dtype))
    named = [(n, p) for n, p in parallel.named_parameters() if p.requires_grad]
    return parallel, named, optimizer.build(p for _, p in named)


def run_layout(layout: Layout, model_config: ModelConfig, seed: int, steps: Sequence[Sequence[PackedBatch]],
               reference: ReferenceModel, first: StepGradients, device: torch.device,
               optimizer: OptimizerSettings, seq_len: int, autocast_dtype: torch.dtype | None = None,
               inject_fault: str | None = None,
               checkpoint: CheckpointSettings | None = None) -> RankMeasurement:
    """`reference` at the seed's weights; `first`: its gradients of steps[0] there (shared by every
    layout, whose first step starts from the same weights). `inject_fault` (tests only): a FAULT_KINDS
    or checkpoint_leg.CHECKPOINT_FAULTS entry, the quantity to spoil. `checkpoint`: run the
    checkpoint leg (checkpoint_leg.py) around the first two steps."""
    config = layout.parallel_config()
    dims = build_mesh(config, device.type)
    def build(at_seed: int):
        return build_layout(layout, model_config, at_seed, dims, device, optimizer, seq_len, autocast_dtype)
    parallel, named, opt = build(seed)
    leg = None
    if checkpoint is not None:
        leg = CheckpointLeg(checkpoint, layout, dims, build, steps[SAVED_AFTER], reference,
                            optimizer.grad_clip, seed, autocast_dtype,
                            inject_fault if inject_fault in CHECKPOINT_FAULTS else None)
    measured = RankMeasurement()
    for index, batch in enumerate(steps):
        expected = first if index == 0 else reference.gradients(batch)
        loss = parallel.train_step(replica_share(batch, dims.rank("dp"), config.dp),
                                   autocast_dtype=autocast_dtype)
        if inject_fault == "grads":
            _inject_fault(named, "grad")
        if leg is not None:
            leg.after_backward(index, named)
        grads, gathered = {}, {}
        for name, p in named:
            # a copy: clipping scales the gradients in place, and an unsharded one is returned as it is
            gathered[name] = full_shape(p.grad if p.grad is not None else torch.zeros_like(p), p,
                                        dims).clone()
            grads[name] = tensor_diff(gathered[name], expected.grads[name], f"gradient of {name}")
        norm = parallel.clip_grad_norm(optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if inject_fault == "params":
            _inject_fault(named, "data")
        coefficient = clip_coefficient(norm.detach().to(device), optimizer.grad_clip)
        reference.step({name: g * coefficient.to(g.dtype) for name, g in gathered.items()})
        if leg is not None:
            leg.keep_gradients(index, gathered)
        del gathered
        params, values = {}, {}
        for name, p in named:
            values[name] = full_shape(p.detach(), p, dims)
            params[name] = tensor_diff(values[name], reference.params[name], name)
        if index + 1 < len(steps):
            _follow_layout(reference, values, model_config, config, dims, seq_len)
        if leg is not None:
            leg.after_step(index, parallel, opt, named, loss, norm, expected, values)
        del values
        measured.losses.append(float(loss))
        measured.scalars.append({"loss": scalar_error(float(loss), expected.loss),
                                 "grad_norm": scalar_error(float(norm), expected.grad_norm)})
        measured.tensors.append({"grads": grads, "params": params})
    if leg is not None:
        measured.checkpoint = leg.finish()
    return measured


def _follow_layout(reference: ReferenceModel, values: dict[str, torch.Tensor], model_config: ModelConfig,
                   config: ParallelConfig, dims: ParallelDims, seq_len: int) -> None:
    """The reference takes the layout's parameters, each from the pipeline rank that holds it
    (a broadcast over the pp group, in the reference's parameter order on every rank)."""
    if config.pp == 1:
        for name, value in values.items():
            reference.load(name, value)
        return
    group = dims.group("pp")
    holders = [parts_of_rank(model_config, config, r, seq_len) for r in range(config.pp)]
    for name in reference.names:
        owner = next(r for r, parts in enumerate(holders) if part_of(name) in parts)
        value = (values[name].contiguous() if owner == dims.rank("pp")
                 else torch.empty_like(reference.params[name]))
        dist.broadcast(value, src=dist.get_global_rank(group, owner), group=group)
        reference.load(name, value)


@torch.no_grad()
def _inject_fault(named, attribute: str) -> None:
    """Test-only (`--inject-fault`): on the last rank, a wrong gradient (`grad`: as a bug in one
    layout's reduction would leave it) or a wrong updated parameter (`data`: a bug in its sharded
    optimizer step). Never reached otherwise."""
    if dist.get_rank() != dist.get_world_size() - 1 or not named:
        return
    tensor = getattr(named[0][1], attribute)
    if tensor is not None:
        (tensor.to_local() if isinstance(tensor, DTensor) else tensor).mul_(FAULT_SCALE)
