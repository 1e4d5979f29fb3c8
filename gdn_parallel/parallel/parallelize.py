"""One entry point: apply every parallel dimension to the single-device model (docs/design.md §3).

Order: tensor parallelism (slices the weights in place) -> pipeline stages (share those weights)
-> data parallelism (FSDP2 shards over dp and replicates over cp; or DDP over dp x cp). Context
parallelism needs no change to the model: each microbatch row is sharded by `shard_batch` and its
CP plan reaches the ops through SequenceInfo.

Loss convention: every rank's loss is its summed token loss divided by the label count of the
whole step (all microbatches, all dp replicas), so gradients summed over dp x cp are the exact
gradient of the single-device mean loss.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm import sends_finished
from ..config import ParallelConfig
from ..model import HybridLM, check_layers
from ..ops.projections import gradients_accumulated_in_place, weights_cast_once
from .batch import all_reduce_gradients, label_count, shard_batch
from .checkpointing import apply_activation_checkpointing
from .data_parallel import apply_data_parallel, clip_grad_norm, global_label_count, global_label_normalizer
from .mesh import ParallelDims
from .offload import BlockInputOffload
from .pipeline import DEFAULT_BALANCE_SEQ_LEN, PipelineRunner, as_microbatch, build_pipeline
from .tensor import apply_tensor_parallel, reduce_tp_partial_grads


@dataclass
class ParallelModel:
    model: HybridLM                 # the local model object (TP-sliced; holds every stage's layers)
    train_module: nn.Module         # what runs the forward when pp == 1 (the DDP wrapper, or model)
    dims: ParallelDims
    config: ParallelConfig
    runner: PipelineRunner | None = None  # when pp > 1
    # a step's micro-batches share each weight's compute-dtype copy (ops.projections.weights_cast_once)
    share_weight_casts: bool = False
    # later micro-batches' weight gradients added in place (ops.projections.gradients_accumulated_in_place)
    accumulate_grads_in_place: bool = False

    # ------------------------------------------------------------------ what the trainer drives
    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains (its pipeline stages' when pp > 1)."""
        if self.runner is not None:
            return list(self.runner.parameters())
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_parameters(self) -> list[tuple]:
        if self.runner is not None:
            return list(self.runner.named_parameters())
        return list(self.model.named_parameters())

    def train_step(self, rows: Sequence, autocast_dtype: torch.dtype | None = None,
                   scaler=None) -> torch.Tensor:
        """Forward + backward of this dp replica's microbatch rows (PackedBatch, on the device).

        Gradients end reduced over every dimension; returns the step's global mean loss (same on
        every rank). `scaler` (a GradScaler, fp16 without pipelining) scales each backward."""
        if scaler is not None and self.runner is not None:
            raise ValueError("a loss scaler (train.dtype=float16) is not supported with pipeline "
                             "parallelism; use bfloat16")
        local_labels = sum(label_count(row) for row in rows)
        normalizer = global_label_normalizer(local_labels, self.dims)
        microbatches = [self._shard(row) for row in rows]
        # The messages of a step's context parallelism live as long as the step.
        plans = [getattr(mb, "context", None) for mb in microbatches]
        with sends_finished(plans), _autocast(autocast_dtype, rows[0].input_ids.device), \
                self._microbatches_of_one_step(len(microbatches)):
            if self.runner is not None:
                loss = self.runner.step(microbatches, label_normalizer=normalizer)
            else:
                loss = self._accumulate(microbatches, normalizer, scaler)
        self._reduce_gradients()
        return self._global_loss(loss)

    @torch.no_grad()
    def evaluate(self, rows: Sequence, autocast_dtype: torch.dtype | None = None) -> tuple[float, int]:
        """(summed token loss, label count) of this dp replica's rows, summed over every replica: the
        same on every rank. Forward only, under every layout."""
        local_labels = sum(label_count(row) for row in rows)
        count = global_label_count(local_labels, self.dims)
        if count == 0:
            return 0.0, 0
        microbatches = [self._shard(row) for row in rows]
        plans = [getattr(mb, "context", None) for mb in microbatches]
        module = self.model
        was_training = module.training
        module.eval()
        try:
            with sends_finished(plans), _autocast(autocast_dtype, rows[0].input_ids.device):
                if self.runner is not None:
                    # this replica's (and cp shard's) share, as every pp rank holds it
                    total = self.runner.evaluate(microbatches, label_normalizer=1.0).float()
                else:
                    total = None
                    for mb in microbatches:
                        mb = as_microbatch(mb, self.model)
                        out = module(mb.input_ids, labels=mb.labels, seq=mb.seq)
                        loss_sum = out.loss_sum.detach().float()
                        total = loss_sum if total is None else total + loss_sum
        finally:
            module.train(was_training)
            self._reshard()
        return float(self._global_loss(total)), count

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.parameters(), max_norm, self.dims)

    # ------------------------------------------------------------------ internals
    def _reshard(self) -> None:
        """Put FSDP2 parameters back into their sharded form after a forward without backward.

        FSDP2 keeps a root module's parameters unsharded after its forward (the backward would
        gather them again at once); with no backward they stay so, and the module then exposes
        the unsharded tensors instead of the sharded parameters the optimizer holds. A checkpoint
        taken then lacked the optimizer state of the root's parameters (embeddings, final norm,
        lm_head) and could not be resumed."""
        from torch.distributed.fsdp import FSDPModule
        roots = [self.model, *(self.runner.stage_modules if self.runner is not None else [])]
        for root in roots:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _shard(self, row):
        if self.config.cp == 1:
            return row
        return shard_batch(row, self.dims.rank("cp"), self.config.cp, self.dims.group("cp"),
                           self.config.cp_algorithm, self.config.cp_attention_split)

    def _accumulate(self, microbatches, normalizer, scaler=None) -> torch.Tensor | None:
        total = None
        for i, mb in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with self._gradient_sync(last):
                mb = as_microbatch(mb, self.model)
                out = self.train_module(mb.input_ids, labels=mb.labels, seq=mb.seq)
                loss = out.loss_sum / normalizer
                (loss if scaler is None else scaler.scale(loss)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def _microbatches_of_one_step(self, count: int) -> contextlib.ExitStack:
        """What the micro-batches of one step share: each weight's cast, and the weight gradients
        added in place after the first (each where this layout allows it: parallelize)."""
        stack = contextlib.ExitStack()
        if count > 1 and self.share_weight_casts:
            stack.enter_context(weights_cast_once())
        if count > 1 and self.accumulate_grads_in_place:
            stack.enter_context(gradients_accumulated_in_place())
        return stack

    def _gradient_sync(self, last: bool):
        """Reduce gradients only with the last microbatch (DDP no_sync / FSDP2 sync switch); FSDP2 kept
        gathered (parallel.fsdp_reshard_after_forward=false) reshards only after the last one's backward,
        so the next step's forward gathers the updated parameters."""
        module = self.train_module
        no_sync = getattr(module, "no_sync", None)
        if no_sync is not None and not last:
            return no_sync()
        set_sync = getattr(module, "set_requires_gradient_sync", None)
        if set_sync is not None:
            set_sync(last)
        set_reshard = getattr(module, "set_reshard_after_backward", None)
        if set_reshard is not None and not self.config.fsdp_reshard_after_forward:
            set_reshard(last)
        return contextlib.nullcontext()

    def _reduce_gradients(self) -> None:
        """FSDP2 and the DDP wrapper reduce over dp x cp during the backward; pipeline stages under
        DDP have no wrapper (the schedule calls the stage modules), so they are summed here."""
        if self.config.tp > 1:
            reduce_tp_partial_grads(self.model, self.dims.group("tp"))
        unwrapped = self.runner is not None and self.config.data_parallel == "ddp"
        if unwrapped and self.config.dp * self.config.cp > 1:
            all_reduce_gradients(self.model, self.dims.dp_cp_mesh.get_group())

    def _global_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        if loss is None:  # every caller passes at least one microbatch; the pipeline broadcasts its loss
            raise RuntimeError("no loss to reduce: the step ran no microbatch on this rank")
        loss = loss.detach().clone()
        if self.config.dp * self.config.cp > 1:
            dist.all_reduce(loss, group=self.dims.dp_cp_mesh.get_group())
        return loss


def parallelize(model: HybridLM, dims: ParallelDims, config: ParallelConfig | None = None,
                device=None, param_dtype: torch.dtype | None = None,
                seq_len: int | None = None, activation_checkpointing: str = "none",
                activation_offload: str = "none", activation_offload_blocks: int = 0,
                recompute_chunks: int = 1, stream_dtype: torch.dtype | None = None) -> ParallelModel:
    """Apply tp, pp, dp (and cp, through the batches) to `model`, initialised identically on every
    rank and already on `device`. `param_dtype` (bf16 on GPU) turns on FSDP2 mixed precision;
    `activation_checkpointing="full"` recomputes every block in the backward (checkpointing.py);
    `activation_offload="cpu"` keeps the inputs it saves of the first `activation_offload_blocks`
    blocks (0: all) in host memory (offload.py); `recompute_chunks` recomputes each block in that many
    sequence chunks (checkpointing.py); `stream_dtype`, the residual stream's dtype in training
    (model.residual_stream_dtype), is what pipeline stages send each other."""
    config = config or dims.config
    config.validate(model.config)
    check_layers(model.config, config.tp, config.cp, recompute_chunks)
    device = device or next(model.parameters()).device
    offload = BlockInputOffload(device) if activation_offload == "cpu" else None
    apply_activation_checkpointing(model, activation_checkpointing, offload,  # first: wraps blocks in place
                                   activation_offload_blocks, recompute_chunks)
    if config.tp > 1:
        apply_tensor_parallel(model, dims.group("tp"), config.sequence_parallel)
    runner = None
    train_module: nn.Module = model
    if config.pp > 1:
        runner = build_pipeline(model, config, device, pp_group=dims.group("pp"),
                                seq_len=seq_len or DEFAULT_BALANCE_SEQ_LEN, stream_dtype=stream_dtype)
        if config.dp * config.cp > 1 and config.data_parallel == "fsdp":
            for stage in runner.stage_modules:
                apply_data_parallel(stage, dims, config, param_dtype)
    elif config.dp * config.cp > 1:
        train_module = apply_data_parallel(model, dims, config, param_dtype)
    return ParallelModel(model, train_module, dims, config, runner,
                         **step_sharing(config, activation_checkpointing, wrapped=train_module is not model))


def step_sharing(config: ParallelConfig, activation_checkpointing: str, wrapped: bool) -> dict[str, bool]:
    """ParallelModel's share_weight_casts and accumulate_grads_in_place for this layout (`wrapped`: the
    model runs inside a DDP or FSDP2 wrapper).

    Shared copies stay alive for the whole step: free where every block saves its weights' copies for
    the backward anyway (no checkpointing), and where FSDP2 does not shard them (it gathers them in the
    compute dtype itself, and shared copies of gathered weights would undo its sharding). Gradients
    added in place bypass autograd's accumulation, from whose hooks DDP and FSDP2 reduce: only where
    neither wraps the model (pipeline stages under DDP are reduced after the step)."""
    fsdp = config.data_parallel == "fsdp" and config.dp * config.cp > 1
    return {"share_weight_casts": activation_checkpointing == "none" and not fsdp,
            "accumulate_grads_in_place": not fsdp and not wrapped}


def _autocast(dtype: torch.dtype | None, device: torch.device):
    """Autocast without its weight-cast cache: the cache outlives a microbatch, and under FSDP2 a
    cached cast would tie the next microbatch's backward to parameters already resharded, which
    silently loses gradient. (weights_cast_once's copies carry no autograd history: each call's
    gradient goes to the weight it was given.)"""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)
