"""`--checkpoint`: does a checkpoint of the layout save and resume exactly?

Driven by layout_run.run_layout, on every rank, between the layout's first and second steps:
  val_loss     the layout evaluates the second step's rows (`ParallelModel.evaluate`, this replica's
               share) at the parameters of step 1; the reference evaluates all of them at the same
               parameters (it has just taken the layout's).
  save         `CheckpointSaver` into a directory every rank sees. The evaluation comes first on
               purpose: under FSDP2 an evaluation once left the root module unsharded, and the
               checkpoint lacked the optimizer state of the embeddings, final norm and lm_head
               (parallelize.py `_reshard`); such a save, or a load of its result, fails the layout.
and once the layout has run its second step uninterrupted:
  resume_same  a fresh model under the same layout, from another seed (a tensor the load misses
               cannot pass for loaded), loads the checkpoint and runs the second step: the loss, the
               gradient norm, every gradient, parameter and optimizer slot after the update must equal
               the uninterrupted step's bit for bit (this rank's local tensors; fp32 or bf16 alike).
  resume_ref   the single-device reference loads the checkpoint (`load_checkpoint` without a layout:
               parameters and AdamW state) and runs the second step: loss, norm and gradients against
               the layout's, and its AdamW update with the layout's gradients (as compare.py explains:
               not with its own) against the layout's parameters, under the run's criteria. When the
               loaded parameters are bit-equal to those the reference computed the uninterrupted
               step's gradients at, those gradients are taken (the same computation, which took
               a quarter of the leg's time on the tiny config).
Only small summaries cross ranks (tensor_diff, the first difference's name); checkpoint_verdict.py
merges and judges them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor

from ..checkpoint import CheckpointSaver, load_checkpoint
from ..checkpoint.files import final_path
from ..checkpoint.manager import layout_record
from ..config import Config, ConfigError
from ..data.packing import PackedBatch
from ..parallel.mesh import ParallelDims
from .batches import replica_share
from .compare import TensorDiff, scalar_error, tensor_diff
from .layouts import Layout
from .reference import ReferenceModel, StepGradients, clip_coefficient

SAVED_AFTER = 1             # steps done when the checkpoint is saved; the next one is resumed from it
CHECKPOINT_FAULTS = ("ckpt", "unsharded")   # --inject-fault kinds of this leg (tests only)
FAULT_SCALE = 1.5           # the spoiled moment, times this (as layout_run's faults)
RESUMED_QUANTITIES = ("loss", "grad_norm", "gradient", "parameter", "optimizer state")   # report order


@dataclass(frozen=True)
class CheckpointSettings:
    """What every layout's leg shares."""
    root: str          # a directory every rank sees (shared_directory); each layout saves below it
    config: Config     # the run's config; each layout's checkpoint records its own parallel section


@dataclass
class RankCheckpoint:
    """What one rank saw of the leg (sent to every rank with all_gather_object)."""
    val_loss: float | None = None             # the layout's evaluation (the same on every rank)
    val_reference: float | None = None
    error: str | None = None                  # a save or load that raised, where and why
    first_difference: tuple[str, str] | None = None   # resumed vs uninterrupted: (quantity, tensor name)
    scalars: dict[str, float] = field(default_factory=dict)                 # resume_ref: loss, grad_norm
    tensors: dict[str, dict[str, TensorDiff]] = field(default_factory=dict)  # resume_ref: grads, params


@dataclass
class Uninterrupted:
    """The layout's own second step on this rank: what a resumed one must reproduce."""
    loss: torch.Tensor
    norm: torch.Tensor
    reference: StepGradients                    # the reference's, at the parameters of the checkpoint
    local: dict[str, dict[str, torch.Tensor]]   # quantity -> name -> this rank's tensor
    grads: dict[str, torch.Tensor]              # full shape, before clipping (resume_ref)
    params: dict[str, torch.Tensor]             # full shape, after the update


class CheckpointLeg:
    """One layout's leg on this rank. `build` makes a fresh (parallel model, named parameters,
    optimizer) of the layout from a seed, as run_layout builds its own (layout_run.build_layout)."""

    def __init__(self, settings: CheckpointSettings, layout: Layout, dims: ParallelDims, build,
                 batch: Sequence[PackedBatch], reference: ReferenceModel, grad_clip: float, seed: int,
                 autocast_dtype: torch.dtype | None, fault: str | None = None):
        self.layout, self.dims, self.build, self.batch = layout, dims, build, batch
        self.reference, self.grad_clip, self.seed = reference, grad_clip, seed
        self.autocast_dtype, self.fault = autocast_dtype, fault
        self.config = dataclasses.replace(
            settings.config, parallel=layout.parallel_config(),
            train=dataclasses.replace(settings.config.train, seed=seed,
                                      activation_checkpointing=layout.activation_checkpointing,
                                      activation_offload=layout.activation_offload))
        self.out_dir = str(Path(settings.root) / "".join(c if c.isalnum() else "_" for c in layout.name))
        self.result = RankCheckpoint()
        self.uninterrupted: Uninterrupted | None = None
        self._grads_before_clipping: dict[str, torch.Tensor] = {}
        self._full_grads: dict[str, torch.Tensor] = {}
        self._reference_at_save: dict[str, torch.Tensor] = {}

    @property
    def path(self) -> Path:
        return final_path(self.out_dir, SAVED_AFTER)

    # ------------------------------------------------------------------ hooks of run_layout
    def after_backward(self, index: int, named) -> None:
        """This rank's gradients, before clipping scales them in place."""
        if index == SAVED_AFTER:
            self._grads_before_clipping = _local(named, lambda p: p.grad)

    def keep_gradients(self, index: int, grads: dict[str, torch.Tensor]) -> None:
        """The layout's gradients at full shape, before clipping."""
        if index == SAVED_AFTER:
            self._full_grads = dict(grads)

    def after_step(self, index: int, parallel, optimizer, named, loss: torch.Tensor, norm: torch.Tensor,
                   expected: StepGradients, params: dict[str, torch.Tensor]) -> None:
        """Step `index` is done (the reference holds the layout's parameters when more steps follow);
        `expected`: the reference's gradients of the step; `params`: the layout's, at full shape."""
        if index == SAVED_AFTER - 1:
            self._reference_at_save = {n: p.detach().clone() for n, p in self.reference.params.items()}
            self._evaluate_and_save(parallel, optimizer)
        elif index == SAVED_AFTER:
            local = {"gradient": self._grads_before_clipping, "parameter": _local(named, lambda p: p),
                     "optimizer state": _slots(named, optimizer)}
            # copies: an unsharded parameter comes as itself, which later steps would move on
            self.uninterrupted = Uninterrupted(loss.detach().clone(), norm.detach().clone(), expected, local,
                                               self._full_grads, {n: p.clone() for n, p in params.items()})

    def finish(self) -> RankCheckpoint:
        """After the layout's run: resume into the same layout and into the reference, then delete
        the checkpoint."""
        try:
            if self.result.error is None:
                self._agree(self._resume_same, "resume into the same layout")
            if self.result.error is None:
                self._agree(self._resume_reference, "resume into the reference")
        finally:
            dist.barrier()   # every rank is done with the files
            if dist.get_rank() == 0:
                shutil.rmtree(self.out_dir, ignore_errors=True)
        return self.result

    # ------------------------------------------------------------------ the parts
    def _evaluate_and_save(self, parallel, optimizer) -> None:
        rows = replica_share(self.batch, self.dims.rank("dp"), self.dims.config.dp)
        loss_sum, count = parallel.evaluate(rows, self.autocast_dtype)
        reference_sum, reference_count = self.reference.evaluate(self.batch)
        self.result.val_loss, self.result.val_reference = loss_sum / count, reference_sum / reference_count
        if self.fault == "unsharded":
            _unshard_roots(parallel)
        saver = CheckpointSaver(self.out_dir)
        self._agree(lambda: saver.save(SAVED_AFTER, parallel.named_parameters(), optimizer, self.dims,
                                       self.config, data_stream={"verify_batch": SAVED_AFTER}), "save")

    def _resume_same(self) -> None:
        parallel, named, optimizer = self.build(self.seed + 1)
        here = layout_record(self.config, dist.get_world_size())
        load_checkpoint(self.path, parallel.named_parameters(), optimizer, self.dims, self.config,
                        same_layout=lambda saved: saved.get("layout") == here)
        if self.fault == "ckpt":
            _spoil_optimizer_slot(named, optimizer)
        rows = replica_share(self.batch, self.dims.rank("dp"), self.dims.config.dp)
        loss = parallel.train_step(rows, autocast_dtype=self.autocast_dtype)
        grads = _local(named, lambda p: p.grad)
        norm = parallel.clip_grad_norm(self.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        resumed = {"loss": {"": loss}, "grad_norm": {"": norm}, "gradient": grads,
                   "parameter": _local(named, lambda p: p), "optimizer state": _slots(named, optimizer)}
        kept = self.uninterrupted
        expected = {"loss": {"": kept.loss}, "grad_norm": {"": kept.norm}, **kept.local}
        self.result.first_difference = _first_difference(resumed, expected)

    def _resume_reference(self) -> None:
        reference, kept = self.reference, self.uninterrupted
        load_checkpoint(self.path, list(reference.model.named_parameters()), reference.optimizer, None,
                        self.config, same_layout=lambda saved: False)
        unchanged = all(torch.equal(p, self._reference_at_save[n]) for n, p in reference.params.items())
        step = kept.reference if unchanged else reference.gradients(self.batch)
        self.result.scalars = {"loss": scalar_error(float(kept.loss), step.loss),
                               "grad_norm": scalar_error(float(kept.norm), step.grad_norm)}
        grads = {name: tensor_diff(g, step.grads[name], f"gradient of {name}")
                 for name, g in kept.grads.items()}
        # clipped as run_layout clips them for the reference: the same operations, the same bits
        coefficient = clip_coefficient(kept.norm.to(reference.device), self.grad_clip)
        reference.step({name: g * coefficient.to(g.dtype) for name, g in kept.grads.items()})
        params = {name: tensor_diff(p, reference.params[name], name) for name, p in kept.params.items()}
        self.result.tensors = {"grads": grads, "params": params}

    def _agree(self, action, what: str) -> None:
        """Run a save or load on every rank; when it raises on any, the leg fails on all of them
        (with the first rank's reason) instead of the job. A collective that some ranks never
        reach cannot be saved this way: the job then hangs or aborts as without the leg."""
        error = None
        try:
            action()
        except (Exception, CheckpointException) as err:  # the layout's failure, named with its cause
            error = f"{what} raised on rank {dist.get_rank()}: {_cause(err)}"
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        self.result.error = next((e for e in errors if e is not None), None)


# ---------------------------------------------------------------------- the directory
@contextlib.contextmanager
def shared_directory(parent: Path) -> Iterator[str]:
    """A temporary directory that rank 0 creates under `parent` and every rank sees (a collective):
    removed at the end. Raises ConfigError on every rank when some rank cannot see it."""
    path, problem = None, None
    if dist.get_rank() == 0:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            path = tempfile.mkdtemp(prefix="gdn-verify-checkpoints-", dir=parent)
        except OSError as err:   # said on every rank, which would otherwise wait for the path
            problem = (f"--checkpoint: cannot make a directory under {parent} ({err}); give --json a path "
                       f"in a writable directory every node shares")
    holder = [path, problem]
    dist.broadcast_object_list(holder, src=0)
    path, problem = holder
    if problem is not None:
        raise ConfigError(problem)
    seen: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(seen, Path(path).is_dir())
    try:
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        if blind:
            raise ConfigError(f"--checkpoint: rank(s) {blind} cannot see {path}, which rank 0 made next to "
                              f"the --json file: give --json a path on a file system every node shares")
        yield path
        dist.barrier()   # every rank is done with it
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- tensors of this rank
def _as_local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _local(named, pick) -> dict[str, torch.Tensor | None]:
    return {name: _as_local(pick(p)) for name, p in named}


def _slots(named, optimizer) -> dict[str, torch.Tensor]:
    return {f"{name}.{slot}": _as_local(value) for name, p in named
            for slot, value in sorted(optimizer.state.get(p, {}).items()) if isinstance(value, torch.Tensor)}


def _first_difference(resumed: dict[str, dict[str, torch.Tensor | None]],
                      expected: dict[str, dict[str, torch.Tensor | None]]) -> tuple[str, str] | None:
    """(quantity, tensor name) of the first tensor, in RESUMED_QUANTITIES order, that is not
    bit-equal (or is missing on one side)."""
    for quantity in RESUMED_QUANTITIES:
        mine, theirs = resumed[quantity], expected[quantity]
        for name in [*theirs, *(n for n in mine if n not in theirs)]:
            a, b = mine.get(name), theirs.get(name)
            if a is None or b is None:
                same = a is None and b is None
            else:
                same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            if not same:
                return quantity, name
    return None


def _cause(err: BaseException) -> str:
    """'Type: first line of the message'; for DCP's CheckpointException (a BaseException that wraps
    every rank's error, tracebacks included), that of the lowest failing rank's error."""
    if isinstance(err, CheckpointException) and err.failures:
        err = err.failures[min(err.failures)][0]
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:400] if lines else ''}"


@torch.no_grad()
def _spoil_optimizer_slot(named, optimizer) -> None:
    """Test-only (`--inject-fault LAYOUT:ckpt`): on the last rank, one AdamW moment after the load,
    as a loader that put a slot's piece in the wrong place would leave it. Never reached otherwise."""
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    for _, p in named:
        slot = optimizer.state.get(p, {}).get("exp_avg")
        local = slot.to_local() if isinstance(slot, DTensor) else slot
        if local is not None and local.numel() and bool(local.ne(0).any()):
            local.mul_(FAULT_SCALE)
            return


def _unshard_roots(parallel) -> None:
    """Test-only (`--inject-fault LAYOUT:unsharded`): the FSDP2 modules unsharded again after the
    evaluation, as the evaluation left them before parallelize.py's `_reshard`."""
    from torch.distributed.fsdp import FSDPModule
    roots = [parallel.model, *(parallel.runner.stage_modules if parallel.runner is not None else [])]
    for root in roots:
        if isinstance(root, FSDPModule):
            root.unshard()
