"""Autograd-aware collectives of tensor parallelism (Megatron's region boundaries, docs/design.md §3).

Inside a tensor-parallel region every rank runs plain local layers on its shard of the heads; the
communication sits only where a region is entered and left. Each boundary is a
torch.autograd.Function whose backward is the conjugate collective:

    without sequence parallelism         with sequence parallelism (residual split over the row)
    enter: copy_to_tp    (id / all-reduce)   gather_sequence         (all-gather / reduce-scatter)
    leave: reduce_from_tp (all-reduce / id)  reduce_scatter_sequence (reduce-scatter / all-gather)

`split_sequence` (take my piece / all-gather) shards a tensor every rank holds in full.
The sequence is dim 1 of [batch, seq, hidden]; the row must split evenly over tp (validated by
ParallelConfig). `vocab_parallel_cross_entropy` is the loss over vocab-sharded logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from ..config import IGNORE_INDEX

SEQ_DIM = 1

# Newer torch renamed the flat-tensor collectives (the old names warn); gloo and NCCL take both.
# The flat buffer holds the ranks' pieces one after another along dim 0.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------- plain collectives (no autograd)
def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group into a fresh tensor (the input may be used elsewhere, e.g. a gradient
    that also flows down the residual stream)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def all_gather_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate the ranks' equally shaped pieces along `dim`, in rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    _all_gather_flat(out, x, group=group)
    return torch.cat(out.chunk(size, dim=0), dim=dim)


def reduce_scatter_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's equal piece along `dim`."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    pieces = x.chunk(size, dim=dim)
    out = x.new_empty(pieces[0].shape)
    _reduce_scatter_flat(out, torch.cat(pieces, dim=0), group=group)
    return out


def split_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} does not split over {size} "
                         f"tensor-parallel ranks")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


# ---------------------------------------------------------------- region boundaries (autograd)
class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.group, ctx.dim), None, None


class _SplitSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.group, ctx.dim), None, None


def copy_to_tp(x, group):
    """Enter a region (no SP): identity forward; the ranks' partial input gradients are summed."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    """Leave a region (no SP): sum the ranks' partial outputs; identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_sequence(x, group, dim: int = SEQ_DIM):
    """Enter a region (SP): all-gather the row; backward reduce-scatters the gradient."""
    return _GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x, group, dim: int = SEQ_DIM):
    """Leave a region (SP): sum partial outputs and keep my piece of the row; backward all-gathers."""
    return _ReduceScatterSequence.apply(x, group, dim)


def split_sequence(x, group, dim: int = SEQ_DIM):
    """Shard a tensor that every rank holds in full (my piece of the row); backward all-gathers."""
    return _SplitSequence.apply(x, group, dim)


# ---------------------------------------------------------------- vocab-parallel cross-entropy
class _VocabParallelCrossEntropy(Function):
    """Summed cross-entropy of logits split over the vocabulary (rank r holds ids
    [r * V_local, (r + 1) * V_local)), without gathering them: the global max, sum of exps and
    target logit are all-reduced. Every rank returns the same loss, and every rank must
    backpropagate that same loss (its gradient is then the gradient of its own logit slice)."""

    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index):
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least, fp64 stays
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local).to(compute)
        labels = labels.reshape(-1)
        valid = labels != ignore_index

        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)  # a fresh tensor: the exps are built in place below

        local_label = labels - dist.get_rank(group) * v_local
        mine = valid & (local_label >= 0) & (local_label < v_local)
        local_label = local_label.masked_fill(~mine, 0)
        target = x.gather(1, local_label.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)

        exps = x.exp_()
        stats = torch.stack([exps.sum(dim=-1), target])  # one all-reduce for both sums
        dist.all_reduce(stats, group=group)
        sum_exp, target = stats[0], stats[1]
        loss = torch.where(valid, sum_exp.log() - target, 0.0).sum()

        ctx.save_for_backward(exps.div_(sum_exp.unsqueeze(-1)), local_label, mine, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, mine, valid = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - onehot(target), on my slice of the vocabulary
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], local_label[mine]] -= 1.0
        grad.mul_((valid.to(grad.dtype) * grad_loss).unsqueeze(-1))
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed cross-entropy over labelled tokens; logits [..., V / tp] (my vocab slice), labels [...]
    (global ids). Equals F.cross_entropy(full_logits, labels, reduction="sum") on every rank."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, ignore_index)
