"""Where a training step's GPU memory goes, measured: one real step of our model (bf16 autocast over fp32
weights, fused AdamW, the trainer's activation checkpointing and offload) at a given context, split into

- weights, gradients and optimizer state (their tensors' bytes);
- what the forward leaves for the backward (under full checkpointing: the blocks' inputs, 8 bytes per
  token and block at hidden size 2048 in the fp32 residual stream; with offload, only those kept);
- the backward in segments, one per recomputed block (from the start of its recomputation to the
  next block's): the memory in use when it starts (gradients so far, inputs not yet consumed) and the
  most it adds (the block's working set: its recomputed activations and their gradients), by layer
  kind; the first segment is the loss and the LM head's backward;
- the optimizer step, and the allocator's reserve beyond the peak (fragmentation).

Used by `tools/bench_train.py --account` and compared with gdn_parallel/train/memory_model.py's
prediction (the trainer prints that one at start-up).
"""
from __future__ import annotations

import time

import torch

from gdn_parallel.config import Config
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.checkpointing import apply_activation_checkpointing
from gdn_parallel.parallel.offload import BlockInputOffload
from gdn_parallel.train.memory_model import predict_peak
from gdn_parallel.train.optim import build_optimizer

GIB = 2 ** 30


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _BackwardSegments:
    """Peak memory between the starts of consecutive block recomputations in a backward."""

    def __init__(self, model: HybridLM, device):
        self.device, self.active, self.segments = device, False, []
        for index, block in enumerate(model.layers):
            block.attn_norm.register_forward_pre_hook(
                lambda _m, _a, i=index, s=block.symbol: self.mark(f"block {i} ({s})"))

    def mark(self, label: str) -> None:
        if not self.active:
            return
        self.close()
        self.segments.append({"label": label, "start_gib": torch.cuda.memory_allocated(self.device) / GIB})
        torch.cuda.reset_peak_memory_stats(self.device)

    def close(self) -> None:
        if self.segments and "peak_gib" not in self.segments[-1]:
            segment = self.segments[-1]
            segment["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            segment["adds_gib"] = segment["peak_gib"] - segment["start_gib"]


def account_step(config: Config, rows: int, device, offload_blocks: int | None = None) -> dict:
    """One measured step at config.train.seq_len tokens x `rows`, the config's activation checkpointing;
    `offload_blocks` (None: no offload, 0: all) as train.activation_offload_blocks."""
    train = config.train
    model = HybridLM(config.model).to(device)
    offload = BlockInputOffload(device) if offload_blocks is not None else None
    apply_activation_checkpointing(model, train.activation_checkpointing, offload, offload_blocks or 0)
    optimizer = build_optimizer(model.parameters(), train, device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.model.vocab_size, (rows, train.seq_len + 1), device=device, generator=gen)
    inputs, labels = ids[:, :-1].reshape(1, -1), ids[:, 1:].reshape(1, -1)
    cu = torch.arange(0, (rows + 1) * train.seq_len, train.seq_len, dtype=torch.int32)
    segments = _BackwardSegments(model, device)

    def step(measure: bool) -> dict:
        found: dict = {}
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start, began = torch.cuda.memory_allocated(device), time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(inputs, labels=labels, cu_seqlens=cu).loss
        found["after_forward_gib"] = torch.cuda.memory_allocated(device) / GIB
        found["forward_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        found["kept_for_backward_gib"] = found["after_forward_gib"] - start / GIB
        segments.active, segments.segments = measure, []
        segments.mark("loss and LM head")
        loss.backward()
        segments.close()
        segments.active = False
        found["after_backward_gib"] = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        found["optimizer_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        found["step_s"] = time.perf_counter() - began
        return found

    step(False)   # compiles the kernels, creates the optimizer state
    step(False)
    weights = _bytes(model.parameters())
    state = _bytes(t for s in optimizer.state.values() for t in s.values())
    torch.cuda.reset_peak_memory_stats(device)
    reserved_before = torch.cuda.memory_reserved(device)
    base = torch.cuda.memory_allocated(device)
    found = step(True)
    backward = segments.segments
    peak = max([found["forward_peak_gib"], found["optimizer_peak_gib"]]
               + [s.get("peak_gib", 0.0) for s in backward])
    by_kind: dict[str, float] = {}
    for s in backward[1:]:
        kind = s["label"].split("(")[-1].rstrip(")")
        by_kind[kind] = max(by_kind.get(kind, 0.0), s["adds_gib"])
    tokens = rows * train.seq_len
    result = {
        "seq_len": train.seq_len, "rows": rows, "activation_checkpointing": train.activation_checkpointing,
        "offload_blocks": offload_blocks, "weights_gib": weights / GIB, "gradients_gib": weights / GIB,
        "optimizer_state_gib": state / GIB, "step_start_gib": base / GIB,
        "other_at_start_gib": (base - weights - state) / GIB, **found, "peak_gib": peak,
        "tokens_per_s": tokens / found["step_s"],
        "reserved_gib": max(torch.cuda.max_memory_reserved(device), reserved_before) / GIB,
        "block_working_set_gib": by_kind,
        "block_working_set_bytes_per_token": {k: v * GIB / tokens for k, v in by_kind.items()},
        "loss_segment_adds_gib": backward[0]["adds_gib"] if backward else None,
        "backward_segments": backward,
        "offloaded_gib": offload.offloaded_bytes / GIB if offload else 0.0,
        "host_pool_gib": offload.pool.bytes / GIB if offload else 0.0,
    }
    predicted = predict_peak(config, rows=rows, offload_blocks=offload_blocks)
    result["predicted"] = predicted.as_dict()
    result["prediction_error"] = predicted.peak_gib / peak - 1.0
    if offload is not None:
        offload.release()
    return result
