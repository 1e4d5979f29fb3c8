"""Linear + cross-entropy without materialising the [tokens, vocab] logits, vocab-parallel aware.

    loss = sum_i [lse_i - z_i[y_i]]  over tokens i with y_i != ignore_index,   z = hidden @ weight.T
    d loss / d z_i = softmax(z_i) - onehot(y_i)      (0 for ignored tokens)
    dhidden = dz @ weight,   dweight = dz.T @ hidden

Tokens are processed in chunks. For each chunk the logits are one matmul in the inputs' dtype
(cuBLAS accumulates in fp32 and rounds to that dtype, exactly as nn.Linear in the unfused path
does); Triton kernels then take per-row max / sum of exps / target logit over vocab blocks (online,
in fp32, or fp64 for fp64 inputs) and overwrite the chunk's logits with dz. dhidden and dweight are
computed right away, so only one chunk of logits lives at a time and backward only scales the
stored gradients by grad_output. Memory beyond inputs and gradients: one chunk of logits and, for
half-precision weights, an fp32 dweight accumulator (V_local x D, one rounding at the end).

Vocab parallelism: `weight` is this rank's rows [vocab_start, vocab_start + V_local) of the full
lm_head and `labels` are global ids. Row max is all-reduced (MAX), then the rescaled sum of exps
and the target logit (non-zero on the owning rank only) are all-reduced (SUM), so every rank holds
the global log-sum-exp and returns the same loss. dweight is exact for the shard; dhidden is this
rank's partial sum dz_local @ weight_local: as in tensor_collectives._VocabParallelCrossEntropy
followed by the sharded lm_head, the caller enters the region with copy_to_tp / gather_sequence,
whose backward sums the partials, and every rank backpropagates the same loss.

Without CUDA and without TRITON_INTERPRET (or without triton) the per-chunk statistics fall back to
plain torch with the same chunking.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .wide_products import add_product_

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton use the torch path below
    triton = None

BLOCK_V = 1024             # vocab columns per step of a row's loop (fixed: no autotune)
NUM_WARPS = 4
CHUNK_ELEMENTS = 1 << 26   # auto chunk: about this many logits per chunk (128 MiB in bf16)

__all__ = ["linear_cross_entropy"]


# ---------------------------------------------------------------- Triton kernels (one row each)
# n_vocab is a constexpr: one compile per vocab-shard width (fixed for a model), the chunk buffer is
# contiguous so it is also the row stride, and loops bounded by it run in the interpreter too.
if triton is not None:
    @triton.jit
    def _row_stats_kernel(logits_ptr, labels_ptr, max_ptr, sumexp_ptr, target_ptr, vocab_start,
                          ignore_index, n_vocab: tl.constexpr, BLOCK: tl.constexpr):
        """Per row: max m, sum exp(z - m), and z[label] when the label is in this vocab slice."""
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * n_vocab  # chunk * vocab may exceed 2**31
        acc = max_ptr.dtype.element_ty  # fp32 (fp64 for fp64 inputs), chosen by the host
        cols = tl.arange(0, BLOCK)
        # The first block is peeled: it always holds a real column, so m is finite from the start
        # and exp(m_old - m_new) never sees -inf - -inf.
        x = tl.load(row_ptr + cols, mask=cols < n_vocab, other=float("-inf")).to(acc)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - m), axis=0)
        for start in range(BLOCK, n_vocab, BLOCK):
            idx = start + cols
            x = tl.load(row_ptr + idx, mask=idx < n_vocab, other=float("-inf")).to(acc)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        label = tl.load(labels_ptr + row)
        local = label - vocab_start
        mine = (label != ignore_index) & (local >= 0) & (local < n_vocab)
        target = tl.load(row_ptr + tl.where(mine, local, 0), mask=mine, other=0.0).to(acc)
        tl.store(max_ptr + row, m)
        tl.store(sumexp_ptr + row, s)
        tl.store(target_ptr + row, tl.where(mine, target, 0.0))

    @triton.jit
    def _softmax_grad_kernel(logits_ptr, labels_ptr, lse_ptr, vocab_start, ignore_index,
                             n_vocab: tl.constexpr, BLOCK: tl.constexpr):
        """Overwrite the row's logits with softmax - onehot (every column; zeros for ignored rows)."""
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * n_vocab
        acc = lse_ptr.dtype.element_ty
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        local = label - vocab_start  # outside [0, n_vocab) when another rank owns the label
        lse = tl.load(lse_ptr + row)
        cols = tl.arange(0, BLOCK)
        for start in range(0, n_vocab, BLOCK):
            idx = start + cols
            mask = idx < n_vocab
            x = tl.load(row_ptr + idx, mask=mask, other=0.0).to(acc)
            g = tl.exp(x - lse) - tl.where(idx == local, 1.0, 0.0).to(acc)
            g = tl.where(valid, g, 0.0)
            tl.store(row_ptr + idx, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _row_stats(logits, labels, vocab_start, ignore_index, acc_dtype):
    """(row max, sum exp(z - max), target logit or 0) for one chunk, each [rows] in acc_dtype."""
    rows, n_vocab = logits.shape
    if _use_triton(logits):
        out = [torch.empty(rows, device=logits.device, dtype=acc_dtype) for _ in range(3)]
        _row_stats_kernel[(rows,)](logits, labels, *out, vocab_start, ignore_index, n_vocab=n_vocab,
                                   BLOCK=BLOCK_V, num_warps=NUM_WARPS)
        return out
    x = logits.to(acc_dtype)
    m = x.max(dim=1).values
    s = (x - m.unsqueeze(1)).exp_().sum(dim=1)
    local = labels - vocab_start
    mine = (labels != ignore_index) & (local >= 0) & (local < n_vocab)
    target = x.gather(1, local.masked_fill(~mine, 0).unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
    return m, s, target


def _softmax_grad_(logits, labels, lse, vocab_start, ignore_index) -> None:
    """logits <- softmax - onehot in place (rows with an ignored label: zeros)."""
    rows, n_vocab = logits.shape
    if _use_triton(logits):
        _softmax_grad_kernel[(rows,)](logits, labels, lse, vocab_start, ignore_index, n_vocab=n_vocab,
                                      BLOCK=BLOCK_V, num_warps=NUM_WARPS)
        return
    g = (logits.to(lse.dtype) - lse.unsqueeze(1)).exp_()
    local = labels - vocab_start
    mine = (labels != ignore_index) & (local >= 0) & (local < n_vocab)
    rows_idx = torch.arange(rows, device=logits.device)
    g[rows_idx[mine], local[mine]] -= 1.0
    g.masked_fill_((labels == ignore_index).unsqueeze(1), 0.0)
    logits.copy_(g)


# ---------------------------------------------------------------- autograd
class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, ignore_index, group, chunk_tokens, need_grad):
        n_tokens, n_vocab = hidden.shape[0], weight.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, fp64 stays fp64
        grad_hidden = need_grad and ctx.needs_input_grad[0]
        grad_weight = need_grad and ctx.needs_input_grad[1]
        dhidden = torch.empty_like(hidden) if grad_hidden else None
        # fp32 accumulator over chunks for half weights: one rounding at the end, not per chunk
        dweight = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if grad_weight else None
        loss = torch.zeros((), device=hidden.device, dtype=acc_dtype)
        buffer = hidden.new_empty(min(chunk_tokens, n_tokens), n_vocab)  # the only logits in memory

        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            h, y = hidden[start:end], labels[start:end]
            z = buffer[:end - start]
            torch.mm(h, weight.t(), out=z)
            row_max, sum_exp, target = _row_stats(z, y, vocab_start, ignore_index, acc_dtype)
            if group is not None:
                # global max first, so the other ranks' sums can be rescaled to it without overflow
                global_max = row_max.clone()
                dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
                stats = torch.stack([sum_exp * torch.exp(row_max - global_max), target])
                dist.all_reduce(stats, group=group)  # one collective for both sums
                row_max, sum_exp, target = global_max, stats[0], stats[1]
            lse = row_max + sum_exp.log()
            loss += torch.where(y != ignore_index, lse - target, 0.0).sum()
            if not (grad_hidden or grad_weight):
                continue
            _softmax_grad_(z, y, lse, vocab_start, ignore_index)  # z now holds d loss / d logits
            if grad_hidden:
                torch.mm(z, weight, out=dhidden[start:end])
            if grad_weight:
                add_product_(dweight, z.t(), h)  # on CUDA into the fp32 accumulator by the product

        ctx.save_for_backward(dhidden, dweight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dhidden, dweight = ctx.saved_tensors
        # d(c * loss) = c * d(loss); scaled in fp32 (grad_loss's dtype), so a half-precision
        # gradient is rounded once more, not scaled by a rounded c.
        gh = None if dhidden is None else (dhidden.to(grad_loss.dtype) * grad_loss).to(dhidden.dtype)
        gw = None
        if dweight is not None:  # multiplied in fp32, stored straight into the weight's dtype
            gw = torch.mul(dweight, grad_loss, out=torch.empty_like(dweight, dtype=ctx.weight_dtype))
        return gh, gw, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int, vocab_start: int = 0, group=None,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` over tokens whose label is not `ignore_index`.

    hidden [..., D], weight [V_local, D] (same dtype), labels [...] (long, global vocab ids in
    [0, V) or ignore_index). Returns a 0-d loss in fp32 (fp64 for fp64 inputs), differentiable for
    hidden and weight. With `group` (tensor parallel), weight holds global rows [vocab_start,
    vocab_start + V_local); the loss is the full-vocabulary loss on every rank and the hidden
    gradient is this rank's partial (see the module docstring). chunk_tokens: tokens per chunk;
    None picks about CHUNK_ELEMENTS logits per chunk.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # The unfused lm_head would run in the autocast dtype; the casts are differentiable, so an
        # fp32 master weight still gets an fp32 gradient.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         f"[..., D] and [V, D]")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be positive")
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels1d = labels.reshape(-1).to(torch.long).contiguous()
    # Gradients are formed during the forward: skip that work when nothing will call backward.
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):  # inputs already share one dtype
        return _LinearCrossEntropy.apply(hidden2d, weight.contiguous(), labels1d, int(vocab_start),
                                         int(ignore_index), group, int(chunk_tokens), need_grad)
