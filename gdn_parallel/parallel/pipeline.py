"""Pipeline parallelism for HybridLM with torch.distributed.pipelining, applied from outside the model.

A pipeline of `pp * virtual_stages` stages holds contiguous layer ranges (`stage_layer_ranges`,
balanced by cost). Stage `s` lives on pp rank `s % pp`: with the 1F1B schedule each rank holds one
stage (stage = pp rank); with the interleaved schedule rank r holds stages r, r + pp, r + 2 pp, ...

What travels between stages is only the hidden state `[B, T, hidden]` (static shape, one tensor).
Everything else a stage needs about a microbatch -- its `SequenceInfo` (document boundaries,
positions, the CP plan) and, on the last stage, its labels -- is handed to every local stage before
the step (`StageModule.set_microbatches`), and the stage learns which microbatch it is running from
the schedule itself: `_Stage.forward_one_chunk(fwd_chunk_id, ...)` is the one entry point both
schedules (1F1B and interleaved, torch 2.11 and 2.13) call for every forward, with the microbatch
index. That is more robust than counting forward calls (a dynamic shape-inference pass would be an
extra call) and than passing an index tensor between stages (integer tensors cannot be received
into the `requires_grad` buffers torch 2.11 allocates, and would need a gradient slot).

The last stage returns the summed cross-entropy of its microbatch (a scalar), and the schedule's
loss function divides it by the step's label count, so the gradients are exactly those of
`sum_mb(loss_sum_mb) / label_normalizer` (gradient scaling by the schedule is switched off).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import sends_finished
from ..comm.links import batched_p2p
from ..config import ConfigError, ModelConfig, ParallelConfig
from ..model.build import part_names
from ..model.hybrid_lm import Block, HybridLM
from ..model.loss import lm_head_loss
from ..model.mixers import mixer_flops_per_token
from ..model.sequence import SequenceInfo

__all__ = ["Microbatch", "PipelineRunner", "StageModule", "as_microbatch", "build_pipeline",
           "stage_costs", "stage_ids_for_rank", "stage_layer_ranges", "uneven_split_line"]

DEFAULT_BALANCE_SEQ_LEN = 4096


# ---------------------------------------------------------------------------------------------
# Balancing the layers over the stages
# ---------------------------------------------------------------------------------------------
def _block_parameters(symbol: str, config: ModelConfig) -> int:
    with torch.device("meta"):
        block = Block(symbol, config)
    return sum(p.numel() for p in block.parameters())


def stage_costs(model_config: ModelConfig, seq_len: int = DEFAULT_BALANCE_SEQ_LEN):
    """(per-layer costs, first-stage extra, last-stage extra), in parameter equivalents.

    A layer costs its parameter count plus its mixer work converted to parameters (a matmul
    parameter is 6 training FLOPs per token, the mixer's forward work is done 3 times: cost =
    params + mixer_flops / 2). The embedding counts toward the first stage with its parameter count
    (its lookup is free, but its weights, gradients and optimizer state are not), the final norm,
    lm_head and the loss (about one softmax over the vocabulary per token) toward the last.
    """
    params = {s: _block_parameters(s, model_config) for s in set(model_config.layer_types)}
    layers = [params[s] + mixer_flops_per_token(s, model_config, seq_len) / 2
              for s in model_config.layer_types]
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    first = vocab * hidden
    last = vocab * hidden + hidden + vocab
    return layers, float(first), float(last)


def stage_layer_ranges(model_config: ModelConfig, num_stages: int,
                       seq_len: int = DEFAULT_BALANCE_SEQ_LEN) -> list[tuple]:
    """Contiguous [start, end) layer ranges, one per stage, every stage at least one layer, chosen
    to minimise the cost of the most expensive stage (ties: the most even split)."""
    n = model_config.n_layers
    if num_stages < 1:
        raise ConfigError(f"the pipeline needs at least one stage, got {num_stages}")
    if num_stages > n:
        raise ConfigError(f"model.n_layers={n} < pipeline stages parallel.pp * virtual_stages = "
                          f"{num_stages}; use fewer stages or more layers")
    layers, first, last = stage_costs(model_config, seq_len)
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> float:
        c = prefix[end] - prefix[start]
        if stage == 0:
            c += first
        if stage == num_stages - 1:
            c += last
        return c

    # best[s][e]: (bottleneck, sum of squares) of stages 0..s covering layers [0, e); exact DP.
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for e in range(1, n - num_stages + 2):
        c = cost(0, 0, e)
        best[0][e] = (c, c * c)
    for s in range(1, num_stages):
        for e in range(s + 1, n - (num_stages - 1 - s) + 1):
            for b in range(s, e):
                prev = best[s - 1][b]
                if prev[0] == math.inf:
                    continue
                c = cost(s, b, e)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][e]:
                    best[s][e], cut[s][e] = cand, b
    ranges, end = [], n
    for s in range(num_stages - 1, 0, -1):
        start = cut[s][end]
        ranges.append((start, end))
        end = start
    ranges.append((0, end))
    return ranges[::-1]


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The stages pp rank `pp_rank` holds: r, r + pp, r + 2 pp, ... (one per virtual stage)."""
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


def stages_per_rank(parallel_config: ParallelConfig) -> int:
    """Pipeline stages each pp rank holds: parallel.virtual_stages under the interleaved schedule."""
    interleaved = parallel_config.pp_schedule == "interleaved" and parallel_config.pp > 1
    return parallel_config.virtual_stages if interleaved else 1


def parts_of_rank(model_config: ModelConfig, parallel_config: ParallelConfig, pp_rank: int,
                  seq_len: int = DEFAULT_BALANCE_SEQ_LEN) -> set:
    """The model parts (model/build.py names) pipeline rank `pp_rank` holds: its stages' layers, the
    embeddings on the first stage, the final norm and lm_head on the last. Every part when pp == 1."""
    if parallel_config.pp == 1:
        return set(part_names(model_config))
    virtual = stages_per_rank(parallel_config)
    num_stages = parallel_config.pp * virtual
    ranges = stage_layer_ranges(model_config, num_stages, seq_len)
    parts: set[str] = set()
    for stage in stage_ids_for_rank(pp_rank, parallel_config.pp, virtual):
        start, end = ranges[stage]
        parts.update(f"layers.{i}" for i in range(start, end))
        if stage == 0:
            parts.add("embeddings")
        if stage == num_stages - 1:
            parts.update(("norm", "lm_head"))
    return parts


def uneven_split_line(model_config: ModelConfig, parallel_config: ParallelConfig,
                      seq_len: int = DEFAULT_BALANCE_SEQ_LEN) -> str | None:
    """A start-up line saying how the layers were split over the pipeline stages, when the stages hold
    different numbers of layers (e.g. 3 over pp=2, or a split the costs tilted); None when even."""
    if parallel_config.pp == 1:
        return None
    virtual = stages_per_rank(parallel_config)
    ranges = stage_layer_ranges(model_config, parallel_config.pp * virtual, seq_len)
    if len({end - start for start, end in ranges}) == 1:
        return None
    stages = ", ".join(
        f"stage {stage}" + (f" (pp rank {stage % parallel_config.pp})" if virtual > 1 else "")
        + f": layer{'s' if end - start > 1 else ''} {start}" + (f"-{end - 1}" if end - start > 1 else "")
        for stage, (start, end) in enumerate(ranges))
    return (f"pipe  | model.n_layers={model_config.n_layers} over {len(ranges)} stages, unevenly (balanced "
            f"by cost; the embeddings weigh on the first stage, the lm_head on the last): {stages}")


# ---------------------------------------------------------------------------------------------
# Microbatches and stage modules
# ---------------------------------------------------------------------------------------------
@dataclass
class Microbatch:
    """What the pipeline needs about one microbatch: the first stage's tokens, the last stage's
    labels and the sequence info every stage's token mixers read."""
    input_ids: torch.Tensor     # [B, T]
    labels: torch.Tensor        # [B, T], IGNORE_INDEX where no target
    seq: SequenceInfo


def as_microbatch(item: Any, model: HybridLM) -> Microbatch:
    """Accept a Microbatch, a CP shard (anything with .sequence_info(), e.g. CPShard) or a packed
    batch (input_ids / labels / cu_seqlens / position_ids, e.g. PackedBatch)."""
    if isinstance(item, Microbatch):
        return item
    if callable(getattr(item, "sequence_info", None)):
        seq = item.sequence_info()
    else:
        seq = model.sequence_info(item.input_ids, getattr(item, "cu_seqlens", None),
                                  getattr(item, "position_ids", None))
    return Microbatch(item.input_ids, item.labels, seq)


class StageModule(nn.Module):
    """One pipeline stage of a HybridLM: shares the parameters of the given model object.

    First stage: embeddings + its layers; middle stages: their layers; last stage: its layers, the
    final norm, lm_head and the loss. Layers keep their global index as name (`layers.7....`), so
    parameter names match the model's.

    forward(x): x is input_ids on the first stage, the hidden state [B, T, hidden] elsewhere.
    Returns the hidden state, or on the last stage the summed cross-entropy of the microbatch (a
    scalar in `loss_dtype`). The microbatch's SequenceInfo and labels come from
    `set_microbatches` + the index selected by `running(index)`, or are given explicitly.
    """

    def __init__(self, model: HybridLM, stage_id: int, num_stages: int, layer_range: tuple,
                 stream_dtype: torch.dtype | None = None):
        super().__init__()
        start, end = layer_range
        if not 0 <= start < end <= len(model.layers):
            raise ValueError(f"stage {stage_id}: layer range {layer_range} is not inside the "
                             f"model's {len(model.layers)} layers")
        self.stage_id, self.num_stages = stage_id, num_stages
        self.layer_range = (start, end)
        self.is_first, self.is_last = stage_id == 0, stage_id == num_stages - 1
        self.embeddings = model.embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.criterion = model.criterion if self.is_last else None
        dtype = next(self.layers.parameters()).dtype
        # what the stages send each other: the residual stream (model.residual_stream_dtype)
        self.hidden_dtype = stream_dtype or dtype
        self.loss_dtype = torch.promote_types(dtype, torch.float32)
        self._residual_stream = model.residual_stream  # a bound method: no module registered twice
        self._microbatches: Sequence[Microbatch] | None = None
        self._current: int | None = None

    # -- the side channel ------------------------------------------------------------------
    def set_microbatches(self, microbatches: Sequence[Microbatch] | None) -> None:
        self._microbatches = microbatches

    @contextmanager
    def running(self, index: int) -> Iterator[None]:
        previous, self._current = self._current, index
        try:
            yield
        finally:
            self._current = previous

    def _microbatch(self) -> Microbatch:
        if self._microbatches is None or self._current is None:
            raise RuntimeError(
                f"stage {self.stage_id} ran a forward without knowing its microbatch: call "
                "set_microbatches() and run inside running(index) (PipelineRunner does both), or pass "
                "seq= (and labels= on the last stage) explicitly")
        return self._microbatches[self._current]

    # -- compute -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, seq: SequenceInfo | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if seq is None or (self.is_last and labels is None):
            mb = self._microbatch()
            seq = seq if seq is not None else mb.seq
            labels = labels if labels is not None else mb.labels
        hidden = x
        if self.is_first:
            if self.embeddings is None:
                raise RuntimeError(f"stage {self.stage_id} is the first but holds no embeddings")
            hidden = self.embeddings(x)
        # Every stage, not only the first: a stream that crossed in another dtype goes on as in one
        # device's model (the casts between fp32 and the autocast dtype are exact).
        hidden = self._residual_stream(hidden)
        for layer in self.layers.values():
            hidden = layer(hidden, seq)
        if not self.is_last:
            # No-ops normally; keep the static activation metadata (shape, dtype and, torch 2.11
            # checks it, stride) exact whatever autocast or a layer does.
            return hidden.to(self.hidden_dtype).contiguous()
        if self.criterion is None or self.lm_head is None or self.norm is None:
            raise RuntimeError(f"stage {self.stage_id} is the last but holds no norm, lm_head or criterion")
        if labels is None:
            raise RuntimeError(f"the last stage {self.stage_id} ran a forward without labels")
        # lm_head_loss: a fused criterion (fuses_lm_head) takes lm_head's weight, not the logits.
        return lm_head_loss(self.criterion, self.lm_head, self.norm(hidden), labels).to(self.loss_dtype)


# ---------------------------------------------------------------------------------------------
# The pipeline stage and the runner
# ---------------------------------------------------------------------------------------------
def _pipelining():
    from torch.distributed import pipelining
    return pipelining


def _make_stage_class():
    PipelineStage = _pipelining().PipelineStage

    class _Stage(PipelineStage):
        """PipelineStage that tells its StageModule which microbatch each forward runs."""

        def __init__(self, stage_module: StageModule, *args, **kwargs):
            super().__init__(stage_module, *args, **kwargs)
            self._stage_module = stage_module   # the unwrapped module, whatever wraps submod later

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self._stage_module.running(fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    return _Stage


class PipelineRunner:
    """Runs forward + backward of a step's microbatches through the pipeline schedule.

    `step(microbatches, label_normalizer)` must be called on every pp rank with the same list (every
    rank needs each microbatch's SequenceInfo; the first stage reads input_ids, the last labels).
    Gradients accumulate into `.grad` of the local stages' parameters (call zero_grad between
    steps) and equal those of `sum_mb(loss_sum_mb) / label_normalizer`; parameters of other ranks'
    stages are not touched. Under context parallelism pass each rank's CP shards (their
    SequenceInfo carries the CPContext) and the global label count; gradients are then this CP
    rank's share (sum them over CP afterwards, as without pipelining).

    Returns the step's loss `sum_mb(loss_sum_mb) / label_normalizer` as a detached 0-d tensor on
    every pp rank (broadcast from the last stage's rank), or None on the ranks without the last
    stage when `broadcast_loss=False`.
    """

    def __init__(self, model: HybridLM, parallel_config: ParallelConfig, device, pp_group=None,
                 pp_rank: int | None = None, pp_size: int | None = None,
                 seq_len: int = DEFAULT_BALANCE_SEQ_LEN,
                 layer_ranges: Sequence[tuple] | None = None, stream_dtype: torch.dtype | None = None):
        self.model = model
        self.config = parallel_config
        self.device = torch.device(device)
        self.pp_group = pp_group
        distributed = dist.is_available() and dist.is_initialized()
        self.pp_size = pp_size if pp_size is not None else (
            dist.get_world_size(pp_group) if distributed else 1)
        self.pp_rank = pp_rank if pp_rank is not None else (
            dist.get_rank(pp_group) if distributed else 0)
        # The config was validated (ParallelConfig.validate: schedule, stages, layers); what is left to
        # check is that the process group it is run on is the one it describes.
        if self.pp_size != parallel_config.pp:
            raise ConfigError(f"the pipeline group has {self.pp_size} ranks but parallel.pp="
                              f"{parallel_config.pp}")
        virtual = stages_per_rank(parallel_config)
        self.interleaved = virtual > 1
        self.num_stages = self.pp_size * virtual
        self.layer_ranges = list(layer_ranges) if layer_ranges is not None else \
            stage_layer_ranges(model.config, self.num_stages, seq_len)
        if len(self.layer_ranges) != self.num_stages:
            raise ValueError(f"{len(self.layer_ranges)} layer ranges for {self.num_stages} stages")
        self.stage_ids = stage_ids_for_rank(self.pp_rank, self.pp_size, virtual)
        self.stage_modules = [StageModule(model, s, self.num_stages, self.layer_ranges[s], stream_dtype)
                              for s in self.stage_ids]
        self.has_first_stage = any(m.is_first for m in self.stage_modules)
        self.has_last_stage = any(m.is_last for m in self.stage_modules)
        self.last_stage_rank = (self.num_stages - 1) % self.pp_size
        self.tied = model.config.tie_word_embeddings
        self._label_normalizer: float | torch.Tensor = 1.0
        self._schedule = None
        self._schedule_key: tuple | None = None

    # -- parameters ----------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages, each once (for the optimizer)."""
        seen, out = set(), []
        for module in self.stage_modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def named_parameters(self) -> list[tuple]:
        """(name in the full model, parameter) for this rank's parameters."""
        local = {id(p) for p in self.parameters()}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) in local]

    # -- the schedule --------------------------------------------------------------------------
    def _loss_fn(self, loss_sum: torch.Tensor, _target: Any) -> torch.Tensor:
        return loss_sum / self._label_normalizer

    def _build_schedule(self, n_microbatches: int, input_shape: tuple):
        pipelining = _pipelining()
        stage_class = _make_stage_class()
        hidden = self.model.config.hidden_size
        stages = []
        for module in self.stage_modules:
            # Static metadata (no shape-inference forward): torch 2.13 derives whether a received
            # activation needs a gradient from requires_grad of these examples.
            if module.is_first:
                inputs = torch.empty(input_shape, dtype=torch.long, device="meta")
            else:
                inputs = torch.empty(*input_shape, hidden, dtype=module.hidden_dtype, device="meta",
                                     requires_grad=True)
            if module.is_last:
                outputs = torch.empty((), dtype=module.loss_dtype, device="meta", requires_grad=True)
            else:
                outputs = torch.empty(*input_shape, hidden, dtype=module.hidden_dtype, device="meta",
                                      requires_grad=True)
            stages.append(stage_class(module, module.stage_id, self.num_stages, self.device,
                                      input_args=(inputs,), output_args=(outputs,),
                                      group=self.pp_group))
        schedule_class = pipelining.ScheduleInterleaved1F1B if self.interleaved else pipelining.Schedule1F1B
        # The loss function already divides by the step's label count: no 1/num_microbatches.
        extra = {"scale_grads": False} if _accepts(schedule_class.__init__, "scale_grads") else {}
        return schedule_class(stages if self.interleaved else stages[0], n_microbatches,
                              loss_fn=self._loss_fn, **extra)

    def _ensure_schedule(self, n_microbatches: int, input_shape: tuple):
        key = (n_microbatches, tuple(input_shape))
        if self._schedule_key != key:
            self._schedule = self._build_schedule(n_microbatches, tuple(input_shape))
            self._schedule_key = key
        return self._schedule

    # -- one step --------------------------------------------------------------------------------
    def step(self, microbatches: Sequence[Any], label_normalizer: float | torch.Tensor,
             broadcast_loss: bool = True) -> torch.Tensor | None:
        mbs = [as_microbatch(m, self.model) for m in microbatches]
        if not mbs:
            raise ValueError("step() needs at least one microbatch")
        shape = tuple(mbs[0].input_ids.shape)
        for i, mb in enumerate(mbs):
            if tuple(mb.input_ids.shape) != shape or tuple(mb.labels.shape) != shape:
                raise ValueError(f"microbatch {i} has input_ids {tuple(mb.input_ids.shape)} / labels "
                                 f"{tuple(mb.labels.shape)}; every microbatch of a step must have "
                                 f"the shape of microbatch 0, {shape} (pipeline buffers are static)")
        # a device tensor (global_label_normalizer over dp) is used as it is: reading it would wait
        self._label_normalizer = (label_normalizer if isinstance(label_normalizer, torch.Tensor)
                                  else float(max(label_normalizer, 1)))
        with sends_finished(mb.seq.cp for mb in mbs):  # context-parallel sends inside the stages
            if self.pp_size == 1:
                return self._step_single(mbs)
            losses = self._run_schedule(mbs, shape)
        if self.tied:
            self._sum_tied_gradients()
        loss = torch.stack([mb_loss.detach() for mb_loss in losses]).sum() if self.has_last_stage else None
        if broadcast_loss:
            if loss is None:
                loss = torch.zeros((), dtype=self.stage_modules[-1].loss_dtype, device=self.device)
            dist.broadcast(loss, src=self._global_rank(self.num_stages - 1), group=self.pp_group)
        return loss

    def _run_schedule(self, mbs: list[Microbatch], shape: tuple) -> list:
        """The torch pipeline schedule over the micro-batches; the last stage's losses."""
        schedule = self._ensure_schedule(len(mbs), shape)
        for module in self.stage_modules:
            module.set_microbatches(mbs)
        try:
            args = (torch.cat([mb.input_ids for mb in mbs]).to(self.device),) if self.has_first_stage else ()
            # The labels reach the last stage through set_microbatches; the schedule still wants a
            # target per microbatch for its loss function.
            target = torch.zeros(len(mbs), device=self.device) if self.has_last_stage else None
            losses: list = []
            kwargs: dict[str, Any] = {"target": target, "losses": losses}
            if _accepts(schedule.step, "return_outputs"):
                kwargs["return_outputs"] = False
            schedule.step(*args, **kwargs)
        finally:
            for module in self.stage_modules:
                module.set_microbatches(None)
        return losses

    def _blocking_p2p(self, op, tensor: torch.Tensor, stage: int) -> None:
        """Send to or receive from `stage`'s rank and wait. Batched, as the schedules' own P2P ops are, so
        it runs on the pp group's communicator (an unbatched op would make a two-rank NCCL communicator
        of its own at the first evaluation, and warn on every rank)."""
        batched_p2p(op, tensor, self._global_rank(stage), self.pp_group).wait()

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[Any], label_normalizer: float) -> torch.Tensor:
        """Forward only: `sum_mb(loss_sum_mb) / label_normalizer` on every pp rank.

        A plain fill-drain pass (no torch schedule: its eval mode differs between versions):
        microbatch after microbatch, stage after stage, blocking send/recv of the hidden state
        between consecutive stages. Every rank walks the same global order, so it cannot deadlock.
        """
        mbs = [as_microbatch(m, self.model) for m in microbatches]
        normalizer = float(max(label_normalizer, 1))
        last = self.stage_modules[-1]
        total = torch.zeros((), dtype=last.loss_dtype, device=self.device)
        hidden = self.model.config.hidden_size
        for module in self.stage_modules:
            module.set_microbatches(mbs)
        try:
            with sends_finished(mb.seq.cp for mb in mbs):
                for index, mb in enumerate(mbs):
                    for module in self.stage_modules:
                        if module.is_first:
                            x = mb.input_ids.to(self.device)
                        else:
                            x = torch.empty(*mb.input_ids.shape, hidden, dtype=module.hidden_dtype,
                                            device=self.device)
                            self._blocking_p2p(dist.irecv, x, module.stage_id - 1)
                        with module.running(index):
                            out = module(x)
                        if module.is_last:
                            total += out / normalizer
                        else:
                            self._blocking_p2p(dist.isend, out, module.stage_id + 1)
        finally:
            for module in self.stage_modules:
                module.set_microbatches(None)
        if self.pp_size > 1:
            if not self.has_last_stage:
                total.zero_()
            dist.broadcast(total, src=self._global_rank(self.num_stages - 1), group=self.pp_group)
        return total

    def _global_rank(self, stage_id: int) -> int:
        rank = stage_id % self.pp_size
        return rank if self.pp_group is None else dist.get_global_rank(self.pp_group, rank)

    def _step_single(self, mbs: list[Microbatch]) -> torch.Tensor:
        """pp = 1: the same math, microbatch after microbatch (gradient accumulation)."""
        (module,) = self.stage_modules
        total = None
        for mb in mbs:
            loss = module(mb.input_ids.to(self.device), seq=mb.seq, labels=mb.labels)
            loss = loss / self._label_normalizer
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if total is None:
            raise ValueError("no microbatches to run (step() checks there is at least one)")
        return total

    def _sum_tied_gradients(self) -> None:
        """Tied embeddings: the weight is used by the first and the last stage, on different pp
        ranks; each holds part of its gradient. Exchange and add (the sum is the same on both)."""
        first_rank, last_rank = 0, self.last_stage_rank
        if first_rank == last_rank or self.pp_rank not in (first_rank, last_rank):
            return
        weight = self.model.embeddings.weight
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        peer = self._global_rank(self.num_stages - 1 if self.pp_rank == first_rank else 0)
        received = torch.empty_like(grad)
        ops = [dist.P2POp(dist.isend, grad, peer, self.pp_group),
               dist.P2POp(dist.irecv, received, peer, self.pp_group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        # Same order of operands on both ranks: (first's part) + (last's part).
        weight.grad = grad + received if self.pp_rank == first_rank else received + grad


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def build_pipeline(model: HybridLM, parallel_config: ParallelConfig, device, pp_group=None,
                   pp_rank: int | None = None, pp_size: int | None = None,
                   seq_len: int = DEFAULT_BALANCE_SEQ_LEN,
                   layer_ranges: Sequence[tuple] | None = None,
                   stream_dtype: torch.dtype | None = None) -> PipelineRunner:
    """Split `model` into `pp * virtual_stages` stages and return this pp rank's runner.

    pp_group: the pipeline process group (default: the world); pp_rank / pp_size default to this
    process's place in it. 1F1B: stage = pp rank; interleaved: rank r holds r, r + pp, ....
    seq_len: the row length the attention costs of the layer balancing assume.
    stream_dtype: the residual stream's dtype in training (model.residual_stream_dtype; default the
    parameters'), which the stages send each other.
    The model must already be on `device` and already carry any other transformation of its
    modules (tensor parallelism swaps lm_head / criterion: apply it first); its parameters are
    shared, not copied (build the optimizer over `runner.parameters()`). A model built with only this
    rank's parts (model.build_model with parts_of_rank) holds no other stage's weights. Data parallel
    wrappers that modify modules in place (FSDP2 fully_shard) can be applied to
    `runner.stage_modules` after this call and before the first step. Microbatches passed to
    `step` must already be on `device` (their SequenceInfo tensors are used as they are).
    """
    return PipelineRunner(model, parallel_config, device, pp_group=pp_group, pp_rank=pp_rank,
                          pp_size=pp_size, seq_len=seq_len, layer_ranges=layer_ranges,
                          stream_dtype=stream_dtype)
