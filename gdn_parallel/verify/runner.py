"""The verification job on every rank: the reference's first gradients once, then each layout in
turn, measured against the reference and judged by the criteria; every rank ends with the same
results."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..data.packing import PackedBatch
from .checkpoint_leg import CheckpointSettings
from .checkpoint_verdict import CheckpointCheck, judge, val_loss_bound
from .compare import (
    TENSOR_SETS,
    Criteria,
    Measured,
    measure_steps,
    merge_rank_diffs,
    scalar_error,
    tensor_diff,
    worst,
)
from .layout_run import RankMeasurement, run_layout
from .layouts import Layout
from .reference import OptimizerSettings, ReferenceModel, StepGradients, clip_coefficient


@dataclass
class LayoutResult:
    layout: Layout
    status: str                        # pass | fail | skipped
    reason: str | None = None       # why skipped, or what failed
    measured: Measured | None = None
    seconds: float = 0.0
    checkpoint: CheckpointCheck | None = None   # --checkpoint


@dataclass
class Verification:
    """Everything the report shows: the reference, the criteria, each layout's result."""
    criteria: Criteria
    reference_loss: float
    results: list[LayoutResult] = field(default_factory=list)
    baseline: Measured | None = None      # bf16 on one device vs fp32 (bf16 runs only)
    reference_seconds: float = 0.0
    val_loss_bound: float | None = None   # --checkpoint runs only
    finished: bool = False                # every layout asked for has run

    @property
    def passed(self) -> bool:
        return self.finished and all(r.status != "fail" for r in self.results)


def single_device_bf16(reference: ReferenceModel, first: StepGradients,
                       steps: Sequence[Sequence[PackedBatch]]) -> Measured:
    """The same model under bf16 autocast on one device against fp32 at the same parameters, step
    after step along its own updates: what bf16 alone costs (the bf16 criterion's yardstick)."""
    scalars, sets = [], []
    reference.reset()
    for index, batch in enumerate(steps):
        exact = first if index == 0 else reference.gradients(batch)
        rounded = reference.gradients(batch, torch.bfloat16)
        scalars.append({"loss": scalar_error(rounded.loss, exact.loss),
                        "grad_norm": scalar_error(rounded.grad_norm, exact.grad_norm)})
        sets.append({"grads": {n: tensor_diff(rounded.grads[n], exact.grads[n], n) for n in reference.names}})
        coefficient = clip_coefficient(torch.tensor(rounded.grad_norm), reference.settings.grad_clip)
        reference.step({n: g * coefficient.to(g.device, g.dtype) for n, g in rounded.grads.items()})
    reference.reset()
    return measure_steps(scalars, sets, reference.names)


def merge_ranks(per_rank: Sequence[RankMeasurement], reference_names) -> Measured:
    steps = range(len(per_rank[0].losses))
    return measure_steps(
        [{q: worst(r.scalars[s][q] for r in per_rank) for q in per_rank[0].scalars[s]} for s in steps],
        [{name: merge_rank_diffs(r.tensors[s][name] for r in per_rank) for name in TENSOR_SETS}
         for s in steps],
        reference_names)


def verify(model_config: ModelConfig, seed: int, steps: Sequence[Sequence[PackedBatch]],
           layouts: Sequence[tuple[Layout, str | None]], device: torch.device,
           optimizer: OptimizerSettings, seq_len: int, precision: str, tolerance: float | None = None,
           faults: dict[str, str] | None = None, progress: Callable[[str], None] = lambda line: None,
           checkpoint: CheckpointSettings | None = None,
           after_layout: Callable[[Verification], None] = lambda result: None) -> Verification:
    """Run the reference and every layout ((layout, skip reason or None)) on this rank. `faults`
    (tests only): {layout name: the quantity to spoil on purpose (layout_run.FAULT_KINDS,
    checkpoint_leg.CHECKPOINT_FAULTS)}. `checkpoint`: each layout also saves and resumes a checkpoint
    (checkpoint_leg.py; needs two steps or more). `after_layout` sees the result so far after each
    layout (the JSON is rewritten then: a run stopped part-way keeps the layouts it finished)."""
    start = time.perf_counter()
    reference = ReferenceModel(model_config, seed, device, optimizer)
    first = reference.gradients(steps[0])
    baseline, autocast_dtype = None, None
    if precision == "bf16":
        autocast_dtype = torch.bfloat16
        baseline = single_device_bf16(reference, first, steps)
    criteria = Criteria.for_run(precision, device.type, tolerance, baseline.errors if baseline else None)
    result = Verification(criteria, first.loss, baseline=baseline,
                          reference_seconds=time.perf_counter() - start,
                          val_loss_bound=(val_loss_bound(criteria, tolerance) if checkpoint is not None
                                          else None))
    progress(f"reference | the first step on one device in {result.reference_seconds:.1f} s "
             f"| loss {first.loss:.4f} | grad norm {first.grad_norm:.4f}")
    runnable = [l for l, reason in layouts if reason is None]
    for layout, reason in layouts:
        if reason is not None:
            result.results.append(LayoutResult(layout, "skipped", reason))
            progress(f"skip      | {layout.name}: {reason}")
            continue
        start = time.perf_counter()
        number = f"[{sum(r.status != 'skipped' for r in result.results) + 1}/{len(runnable)}]"
        progress(f"run       | {number} {layout.name}")   # a crash inside the layout is then named
        reference.reset()
        try:
            mine = run_layout(layout, model_config, seed, steps, reference, first, device, optimizer, seq_len,
                              autocast_dtype, inject_fault=(faults or {}).get(layout.name),
                              checkpoint=checkpoint)
        except Exception as err:
            raise RuntimeError(f"layout {layout.name} raised on rank {dist.get_rank()}: "
                               f"{type(err).__name__}: {err}") from err
        per_rank: list[RankMeasurement | None] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        measured = merge_ranks(per_rank, reference.names)
        failures = criteria.failures(measured.errors)
        if measured.missing:
            failures.insert(0, f"no rank holds {', '.join(measured.missing)}")
        check = None
        if checkpoint is not None:
            check = judge([r.checkpoint for r in per_rank], criteria, result.val_loss_bound, reference.names)
            failures += check.failures
        outcome = LayoutResult(layout, "fail" if failures else "pass", "; ".join(failures) or None, measured,
                               time.perf_counter() - start, check)
        result.results.append(outcome)
        progress(f"{outcome.status:<9} | {number} {layout.name} in {outcome.seconds:.1f} s"
                 + (f": {outcome.reason}" if outcome.reason else ""))
        after_layout(result)
    result.finished = True
    return result
