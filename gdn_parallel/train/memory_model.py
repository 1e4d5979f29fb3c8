"""Peak GPU memory of a training step, predicted from the config before anything is built.

    peak = weights + gradients + optimizer state                 (fp32 each; AdamW: two moments)
         + the block inputs kept for the backward on the GPU     (full checkpointing: one row of
                                                                  hidden_size per token and block, in
                                                                  the residual stream's dtype: fp32, or
                                                                  bf16 with model.residual_in_fp32 off)
         + the largest working set of one block in the backward  (its recomputed activations and
                                                                  their gradients, linear in tokens)
         + the loss's rows (the final norm's input, the fused cross-entropy's hidden gradient)

In the backward, block by block from the last, gradients fill in while the kept inputs are released
(with offload, one comes back ahead of its block): the model walks the blocks and takes the largest
total, which at long context is near the end (every gradient there) or, without offload, at the
start. The per-token working sets are counted from the tensors each layer kind keeps (bf16 under
autocast) and checked against measurements (tools/memory_account.py, docs/benchmarks.md "Memory at
long context").

Per rank: tokens are divided by parallel.cp, parameters and optimizer state by the FSDP2 shard
(dp: they are replicated over cp, parallel/data_parallel.py; with parallel.fsdp_reshard_after_forward
off the weights add every block's gathered copy in the compute dtype), and the layers by pipeline stage;
tensor parallelism divides the blocks' weights and working sets by tp (the residual stream only
under sequence parallelism). Checked on one GPU and under cp = 2 and 4 (docs/benchmarks.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..config import Config, ModelConfig
from ..model import HybridLM, residual_stream_dtype
from ..model.mixers import MIXERS, mixer_kinds
from .optim import autocast_dtype

GIB = 2 ** 30
FP32, BF16 = 4, 2


@dataclass
class MemoryPrediction:
    weights_gib: float
    gradients_gib: float
    optimizer_state_gib: float
    block_inputs_gib: float       # kept on the GPU for the backward
    offloaded_gib: float          # held in host memory instead (train.activation_offload=cpu)
    working_set_gib: float        # the largest block's, in the backward
    loss_gib: float
    peak_gib: float

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self, capacity_gib: float | None = None) -> str:
        of = f" of {capacity_gib:.1f} GiB" if capacity_gib else ""
        parts = (f"weights {self.weights_gib:.1f}, gradients {self.gradients_gib:.1f}, optimizer "
                 f"{self.optimizer_state_gib:.1f}, block inputs {self.block_inputs_gib:.1f}"
                 + (f" (+{self.offloaded_gib:.1f} on the host)" if self.offloaded_gib else "")
                 + f", working set {self.working_set_gib:.1f}, loss {self.loss_gib:.1f}")
        return f"predicted peak {self.peak_gib:.1f} GiB{of} ({parts})"


def activation_bytes_per_token(symbol: str, model: ModelConfig,
                               stream_bytes: int = FP32) -> tuple[float, float]:
    """(kept, gradients): bytes per token one block of layer kind `symbol` keeps for its backward, and
    the gradients its backward holds beside them. Its mixer's (MixerKind.activation_bytes_per_token)
    with the block's own: its input and the sum after its mixer (the residual stream, `stream_bytes`
    an element), the two
    norms' outputs, the MLP's gate, up and SwiGLU product (bf16). Checked on an H100
    (tools/memory_account.py): a GDN block's working set 111.6 KiB/token measured against 110.6
    counted at hidden 2048, a sliding-window block's 84.8 against 83.6."""
    H, inter = model.hidden_size, model.mlp_dim
    common = stream_bytes * 2 * H + BF16 * 2 * H + BF16 * 3 * inter
    kept, gradients = MIXERS[symbol].activation_bytes_per_token(model)
    return common + kept, gradients


def _layer_parameters(model: ModelConfig) -> tuple[list[int], int]:
    """Parameters of each block, and of the rest (embeddings, final norm, LM head)."""
    with torch.device("meta"):   # sizes without memory
        skeleton = HybridLM(model)
    blocks = [sum(p.numel() for p in block.parameters()) for block in skeleton.layers]
    return blocks, skeleton.num_parameters() - sum(blocks)


def _kept_gathered(config: Config, shard: int, params: float) -> float:
    """FSDP2's gathered copy of the rank's `params` (its stages', a tp-th), kept all step long when
    parallel.fsdp_reshard_after_forward is off, in the compute dtype."""
    if shard == 1 or config.parallel.fsdp_reshard_after_forward:
        return 0.0
    gathered_dtype = autocast_dtype(config.train.dtype, torch.device("cuda")) or torch.float32
    return gathered_dtype.itemsize * params


def predict_peak(config: Config, rows: int | None = None,
                 offload_blocks: int | None = None) -> MemoryPrediction:
    """The peak of one rank. `rows`: sequences per forward/backward (default: the config's micro-batch);
    `offload_blocks`: None reads train.activation_offload(_blocks), else as that setting (0: all)."""
    model, train, par = config.model, config.train, config.parallel
    rows = rows or train.microbatch_rows
    tp, pp, cp = par.tp, par.pp, par.cp
    tokens = rows * train.seq_len / cp
    block_params, rest = _layer_parameters(model)
    blocks = math.ceil(model.n_layers / pp)
    symbols = model.layer_types[:blocks]
    block_params = [n / tp for n in block_params[:blocks]]
    shard = par.dp if par.data_parallel == "fsdp" else 1   # HSDP: replicated over cp
    unsharded = sum(block_params) + rest / tp
    local = unsharded / shard
    weights, optimizer = FP32 * local + _kept_gathered(config, shard, unsharded), 2 * FP32 * local
    # one hidden row of the residual stream (on the GPU, where autocast runs)
    stream_bytes = residual_stream_dtype(model, autocast_dtype(train.dtype, torch.device("cuda"))).itemsize
    row = stream_bytes * model.hidden_size * tokens / (tp if par.sequence_parallel else 1)
    if offload_blocks is None:
        offload_blocks = train.activation_offload_blocks if train.activation_offload == "cpu" else None
    if offload_blocks is None:
        offloaded = 0
    else:
        offloaded = blocks if offload_blocks == 0 else min(offload_blocks, blocks)
    full = train.activation_checkpointing == "full"
    activations = [activation_bytes_per_token(s, model, stream_bytes) for s in symbols]
    # a block in its backward: its activations (recomputed under full checkpointing), their gradients,
    # its bf16 weight casts and fp32 weight-gradient transients
    # under chunked recomputation one chunk's at a time, and the block input's gradient assembled whole
    chunks = train.recompute_chunks if full else 1
    assembled = row if chunks > 1 else 0.0
    working = [(kept + grads) * tokens / chunks / tp + 3 * n + assembled
               for (kept, grads), n in zip(activations, block_params)]
    # The backward, block by block from the last: gradients so far, what is still kept of the blocks
    # below, the gradient flowing down the residual stream (and, under offload, the next input coming
    # back), and the block's own working set. Without full checkpointing every block below keeps its
    # activations instead of its input. With gradient accumulation a later micro-batch finds every
    # gradient there, whole under FSDP2 too (fp32 unsharded_accumulated_grad until the last reduces).
    accumulating = train.batch_size > rows
    grads = FP32 * (unsharded if accumulating else rest / tp / shard)
    peak_backward, kept_at_peak, working_at_peak = 0.0, 0.0, 0.0
    for index in reversed(range(blocks)):
        grads += 0.0 if accumulating else FP32 * block_params[index] / shard
        if full:
            kept = sum(row for i in range(index) if i >= offloaded) + (row if index and offloaded else 0.0)
        else:   # activations and the bf16 weight casts of every block below
            kept = sum(activations[i][0] * tokens / tp + 2 * block_params[i] for i in range(index))
        total = grads + kept + row + working[index]
        if total > peak_backward:
            peak_backward, kept_at_peak, working_at_peak = total, kept, working[index]
    # The loss: the final norm's input (a row of the stream) and the fused cross-entropy's hidden
    # gradient (an fp32 row) are kept from the forward; its backward adds a chunk of logits
    loss = row + row * FP32 / stream_bytes
    peak = weights + optimizer + peak_backward + loss
    return MemoryPrediction(
        weights_gib=weights / GIB, gradients_gib=FP32 * local / GIB, optimizer_state_gib=optimizer / GIB,
        block_inputs_gib=kept_at_peak / GIB, offloaded_gib=(offloaded * row) / GIB,
        working_set_gib=working_at_peak / GIB, loss_gib=loss / GIB, peak_gib=peak / GIB)


# The settings tried, in order, when a run does not fit: each one is added to the ones before it.
REMEDIES = (("train.activation_checkpointing", "full"), ("train.activation_offload", "cpu"))
# How far a measured peak has been from the prediction (docs/benchmarks.md): a run predicted above the
# device by more than this is refused; within it, only warned about.
PREDICTION_ERROR = 0.10


def settings_that_fit(config: Config, capacity_gib: float) -> list[str]:
    """Overrides (KEY=VALUE) under which the prediction fits `capacity_gib`: the remedies in order,
    then smaller micro-batches, then more context-parallel ranks; [] when none found."""
    tried, overrides = config, []
    for field, value in REMEDIES:
        section, name = field.split(".")
        if getattr(getattr(tried, section), name) == value:
            continue
        tried = tried.with_overrides([f"{field}={value}"])
        overrides.append(f"{field}={value}")
        if predict_peak(tried).peak_gib <= capacity_gib:
            return overrides
    rows = tried.train.microbatch_rows
    while rows > 1:
        rows //= 2
        if predict_peak(tried, rows=rows).peak_gib <= capacity_gib:
            return overrides + [f"train.microbatch_size={rows}"]
    fewer_rows = ["train.microbatch_size=1"] if tried.train.microbatch_rows > 1 else []
    for chunks in _chunk_counts(tried):
        chunked = tried.with_overrides([f"train.recompute_chunks={chunks}"])
        if predict_peak(chunked, rows=1).peak_gib <= capacity_gib:
            return overrides + fewer_rows + [f"train.recompute_chunks={chunks}"]
    # only where every layer runs over context-parallel ranks (MixerKind.context_parallel)
    every_layer_splits = all(kind.context_parallel.across_ranks for kind in mixer_kinds(tried.model))
    for cp in (2, 4, 8, 16, 32, 64) if every_layer_splits else ():
        wider = tried.with_overrides([f"parallel.cp={cp}"])
        if cp > tried.parallel.cp and predict_peak(wider, rows=1).peak_gib <= capacity_gib:
            return overrides + fewer_rows + [
                f"parallel.cp={cp} (x{cp // tried.parallel.cp} GPUs per sequence)"]
    return []


def _chunk_counts(config: Config) -> list[int]:
    """The train.recompute_chunks worth trying: where the model and layout take chunks at all (every
    layer runs in chunks, MixerKind.context_parallel; the relay; no sequence parallelism), counts
    dividing a rank's tokens."""
    par = config.parallel
    every_layer_chunks = all(kind.context_parallel.across_chunks for kind in mixer_kinds(config.model))
    if (config.train.activation_checkpointing != "full" or par.cp_algorithm != "relay"
            or par.sequence_parallel or not every_layer_chunks):
        return []
    tokens = config.train.seq_len // par.cp
    return [c for c in (2, 4, 8, 16) if c > config.train.recompute_chunks and tokens % c == 0]
