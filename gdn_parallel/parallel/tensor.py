"""Megatron-style tensor parallelism, applied to the single-device HybridLM from outside (docs/design.md §3).

`apply_tensor_parallel(model, tp_group, sequence_parallel)` runs after the full model was
initialised identically on every rank; each rank keeps its slice of the full weights:

- token mixers and MLPs split their heads / width over tp: column-parallel projections in (output
  rows), row-parallel projections out (input columns), plain local nn.Linear shards inside. Each
  mixer's plan is data on its registry entry (model/mixers.py, `MixerKind.tensor_parallel`), read
  here by one interpreter (`_shard_mixer`): e.g. GDN q/k rows by q/k head, v/g/a/b rows, conv
  channels and A_log/dt_bias by value head; attention q/output-gate rows, KV heads split when
  num_kv_heads % tp == 0, otherwise replicated (each rank keeps all KV weights and computes the
  one head its query heads read). MLP: gate/up rows, down columns.
- communication only at region boundaries (tensor_collectives): forward hooks on each Block's
  `attn` and `mlp` enter and leave the region, so parameter names stay the single-device names
  (checkpoints, optimizer groups and FSDP see the same model).
- vocab-parallel embedding and lm_head (logits stay split over the vocabulary) and a
  vocab-parallel cross-entropy that returns the same summed loss on every tp rank (the fused
  linear + cross-entropy when the model was built with it).

Sequence parallelism: input_ids, labels and SequenceInfo stay those of the full local row on
every tp rank, so `model(...)` is called exactly as without it. The embedding reduce-scatters its
output to this rank's piece of the row ([B, T / tp, H]); norms and residual adds run on that piece;
each mixer/MLP all-gathers the row on entry (mixers see the whole row: positions, cu_seqlens and
the CP plan apply unchanged) and reduce-scatters on exit; lm_head all-gathers the final hidden.

Parameter metadata (other code relies on it): sharded parameters carry `_tp_shard_dim`;
parameters replicated over tp whose gradient is only a partial sum on each rank (GDN o_norm;
norms under SP; replicated KV projections) carry `_tp_partial_grad = True` and need
`reduce_tp_partial_grads` after backward. FSDP2's fully_shard creates new parameter objects
without these attributes; data_parallel.apply_data_parallel saves and restores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model import MIXERS, HybridLM, SwiGLU, TensorParallelLayout, blocks_of
from ..ops.cross_entropy import linear_cross_entropy
from .batch import all_reduce_flat
from .tensor_collectives import (
    all_gather_dim,
    copy_to_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_sequence,
    vocab_parallel_cross_entropy,
)

__all__ = ["apply_tensor_parallel", "local_tensor", "reduce_tp_partial_grads", "full_tensor",
           "sequence_shard", "tp_shard_dim", "TensorParallelPlan", "VocabParallelEmbedding",
           "VocabParallelCrossEntropy", "VocabParallelLinearCrossEntropy", "ReplicatedHeadLinear"]


# Parameter metadata attributes (module docstring), set by _mark_shard_dim and _mark_partial.
TP_SHARD_DIM, TP_PARTIAL_GRAD = "_tp_shard_dim", "_tp_partial_grad"
PLAN_ATTRIBUTE = "tensor_parallel"  # the model's TensorParallelPlan, once applied


@dataclass
class TensorParallelPlan:
    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool


def apply_tensor_parallel(model: HybridLM, tp_group, sequence_parallel: bool = False) -> None:
    """In place. Also takes a pipeline stage of a HybridLM: `layers` may be an nn.ModuleDict and
    embeddings / norm / lm_head may be missing or None on the stages that do not own them."""
    if getattr(model, PLAN_ATTRIBUTE, None) is not None:
        raise RuntimeError("apply_tensor_parallel was already applied to this model")
    plan = TensorParallelPlan(tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group),
                              sequence_parallel)
    shard = _Sharder(plan.size, plan.rank)
    for block in blocks_of(model):
        _shard_mixer(block.attn, MIXERS[block.symbol].tensor_parallel, shard)
        _shard_mlp(block.mlp, shard)
        for region in (block.attn, block.mlp):
            _make_region(region, plan)
        if sequence_parallel:  # each rank normalises only its piece of the row
            _mark_partial(block.attn_norm.weight, block.mlp_norm.weight)

    # Embedding and lm_head are both split by vocabulary rows; a tied weight is sliced once.
    if getattr(model, "embeddings", None) is not None:
        embeddings = VocabParallelEmbedding(shard(model.embeddings, "weight", 0), plan)
        # a drop-in for the nn.Embedding (weight, num_embeddings, embedding_dim; called on the ids)
        model.embeddings = cast(nn.Embedding, embeddings)
    if sequence_parallel and getattr(model, "norm", None) is not None:
        _mark_partial(model.norm.weight)
    if getattr(model, "lm_head", None) is not None:
        shard.column(model.lm_head)
        enter = partial(gather_sequence if sequence_parallel else copy_to_tp, group=tp_group)
        model.lm_head.register_forward_pre_hook(lambda _module, args: (enter(args[0]), *args[1:]))
        if getattr(model.criterion, "fuses_lm_head", False):  # it never calls lm_head: enters itself
            chunk_tokens = getattr(model.criterion, "chunk_tokens", None)
            model.criterion = VocabParallelLinearCrossEntropy(plan, chunk_tokens)
        else:
            model.criterion = VocabParallelCrossEntropy(tp_group)
    setattr(model, PLAN_ATTRIBUTE, plan)


# ---------------------------------------------------------------- slicing the layers
class _Sharder:
    """Replaces module.<name> by this rank's equal slice of it along `dim` (head-aligned, since the
    head counts divide by tp). Remembers what it sliced, so a tied weight stays one parameter."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank
        self.done: dict[int, nn.Parameter] = {}

    def __call__(self, module: nn.Module, name: str, dim: int):
        full = getattr(module, name)
        if full is None:
            return None
        if id(full) not in self.done:
            if full.shape[dim] % self.size:
                raise ValueError(f"{type(module).__name__}.{name} of shape {tuple(full.shape)} does not "
                                 f"split over tp={self.size} along dim {dim}")
            piece = full.shape[dim] // self.size
            local = nn.Parameter(full.detach().narrow(dim, self.rank * piece, piece).clone(),
                                 requires_grad=full.requires_grad)
            local.__dict__.update(full.__dict__)  # keep flags such as _no_weight_decay
            _mark_shard_dim(local, dim)
            self.done[id(full)] = local
        setattr(module, name, self.done[id(full)])
        return self.done[id(full)]

    def column(self, linear: nn.Linear) -> None:
        """Split the outputs (weight rows, bias)."""
        self(linear, "weight", 0)
        self(linear, "bias", 0)

    def row(self, linear: nn.Linear) -> None:
        """Split the inputs (weight columns); a bias would be added once per rank, so none is allowed."""
        if linear.bias is not None:
            raise ValueError("a row-parallel projection with a bias is not supported")
        self(linear, "weight", 1)


def _owner(module: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    """(the module holding attribute `path` of `module`, its last name); None when a module on the way
    is absent (an optional part)."""
    *parents, name = path.split(".")
    for parent in parents:
        module = getattr(module, parent)
        if module is None:
            return None, name
    return module, name


def _shard_mixer(m: nn.Module, layout: TensorParallelLayout, shard: _Sharder) -> None:
    """Apply a mixer's registered plan (model/mixers.py); optional parts that are None are skipped."""
    for path in layout.column:
        owner, name = _owner(m, path)
        if owner is not None and getattr(owner, name) is not None:
            shard.column(getattr(owner, name))
    for path, dim in layout.split:
        owner, name = _owner(m, path)
        if owner is not None:
            shard(owner, name, dim)
    kv = layout.grouped_kv
    if kv is not None:
        count = getattr(m, kv.count)
        if count % shard.size == 0:
            for path in kv.projections:
                shard.column(getattr(m, path))
            setattr(m, kv.count, count // shard.size)
        else:  # fewer KV heads than ranks (tp % count == 0): this rank's query heads read one
            head = shard.rank // (shard.size // count)
            for path in kv.projections:
                setattr(m, path, ReplicatedHeadLinear(getattr(m, path), head, getattr(m, kv.head_dim)))
            setattr(m, kv.count, 1)
    for path in layout.row:
        owner, name = _owner(m, path)
        shard.row(getattr(owner, name))
    for path in layout.partial_grad:
        owner, name = _owner(m, path)
        if owner is not None:         # an optional part (attention's q_norm) the config left out
            _mark_partial(getattr(owner, name))
    for name in layout.heads:
        setattr(m, name, getattr(m, name) // shard.size)


def _shard_mlp(m: SwiGLU, shard: _Sharder) -> None:
    shard.column(m.gate_proj)
    shard.column(m.up_proj)
    shard.row(m.down_proj)


def tp_shard_dim(param: torch.Tensor) -> int | None:
    """The dim along which `param` is this rank's tp slice; None for a parameter replicated over tp."""
    return getattr(param, TP_SHARD_DIM, None)


def _mark_shard_dim(param: nn.Parameter, dim: int) -> None:
    """Record that `param` is this rank's slice along `dim` (module docstring: parameter metadata)."""
    setattr(param, TP_SHARD_DIM, dim)


def _mark_partial(*params: torch.Tensor) -> None:
    """Flag parameters whose gradient is a partial sum over tp (module docstring: parameter metadata)."""
    for p in params:
        setattr(p, TP_PARTIAL_GRAD, True)


def _make_region(module: nn.Module, plan: TensorParallelPlan) -> None:
    """Communication at the region's boundaries only: forward(x, *rest) sees the (gathered) input
    and its output is summed over the ranks (and scattered back to the row pieces under SP)."""
    sp, group = plan.sequence_parallel, plan.group
    enter = partial(gather_sequence if sp else copy_to_tp, group=group)
    leave = partial(reduce_scatter_sequence if sp else reduce_from_tp, group=group)
    module.register_forward_pre_hook(lambda _module, args: (enter(args[0]), *args[1:]))
    module.register_forward_hook(lambda _module, _args, out: leave(out))


class ReplicatedHeadLinear(nn.Module):
    """A KV projection replicated over tp: every rank holds all heads (same parameters, same names
    as the nn.Linear it replaces) and computes the one head its query heads need. Its gradient on a
    rank covers that head only, hence `_tp_partial_grad`."""

    def __init__(self, linear: nn.Linear, head: int, head_dim: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        _mark_partial(*(p for p in (self.weight, self.bias) if p is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.rows]
        return F.linear(x, self.weight[self.rows], bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V / tp, (rank + 1) * V / tp) of the embedding; ids outside give zeros, and the
    ranks' outputs are summed (all-reduce, or reduce-scatter to this rank's row piece under SP)."""

    def __init__(self, weight: nn.Parameter, plan: TensorParallelPlan):
        super().__init__()
        self.weight = weight
        self.plan = plan
        self.vocab_start = plan.rank * weight.shape[0]
        self.num_embeddings, self.embedding_dim = weight.shape[0] * plan.size, weight.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.plan.sequence_parallel:
            return reduce_scatter_sequence(out, self.plan.group)
        return reduce_from_tp(out, self.plan.group)


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for TokenCrossEntropy on vocab-split logits: the same summed loss on every tp rank."""

    fuses_lm_head = False

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.group)


class VocabParallelLinearCrossEntropy(nn.Module):
    """Drop-in for LinearCrossEntropy with lm_head's weight split by vocabulary rows: the same
    summed loss on every tp rank. It enters the region as lm_head's pre-hook does (copy_to_tp, or
    gather_sequence under SP); their backward sums the ranks' partial hidden gradients, exactly as
    for vocab_parallel_cross_entropy after the sharded lm_head."""

    fuses_lm_head = True

    def __init__(self, plan: TensorParallelPlan, chunk_tokens=None):
        super().__init__()
        self.plan = plan
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        hidden = (gather_sequence if plan.sequence_parallel else copy_to_tp)(hidden, plan.group)
        return linear_cross_entropy(hidden, weight, labels, vocab_start=plan.rank * weight.shape[0],
                                    group=plan.group, chunk_tokens=self.chunk_tokens)


# ---------------------------------------------------------------- gradients, gathering, metadata
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (an FSDP2 parameter's dp shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_tp_partial_grads(model: nn.Module, tp_group) -> None:
    """Sum the gradients of `_tp_partial_grad` parameters over tp (one flat all-reduce per dtype).
    Call once per step after backward (after gradient accumulation), before clipping and the
    optimizer step. It commutes with the dp x cp reduction (both are sums over orthogonal groups)."""
    all_reduce_flat([local_tensor(p.grad) for p in model.parameters()
                     if getattr(p, TP_PARTIAL_GRAD, False) and p.grad is not None], tp_group)


def full_tensor(t: torch.Tensor, param: nn.Parameter, tp_group) -> torch.Tensor:
    """`t` (the parameter or its gradient) at the full single-device shape: all-gathered along
    `param._tp_shard_dim` when sharded over tp (an FSDP2 DTensor is first gathered over dp).
    A collective: every tp rank must call it for the same parameter."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    dim = tp_shard_dim(param)
    return t.detach() if dim is None else all_gather_dim(t.detach(), tp_group, dim)


def sequence_shard(x: torch.Tensor, tp_group) -> torch.Tensor:
    """This rank's piece ([B, T / tp, ...]) of a row every tp rank holds in full, as the residual
    stream is laid out under SP; differentiable (backward all-gathers). The embedding does this
    itself (fused with its reduction); use it for hidden states entering the model another way."""
    return split_sequence(x, tp_group)
