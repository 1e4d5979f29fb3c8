"""The checkpoint leg's verdict on a layout (every rank, from every rank's RankCheckpoint):
  val_loss     relative error of the layout's evaluation vs the reference's <= VAL_LOSS_TOLERANCE in
               fp32 (--tolerance replaces it); the loss criterion in bf16;
  resume_same  no tensor of the resumed step differs from the uninterrupted one (the first that
               does: its quantity, name and rank);
  resume_ref   the reference resumed from the checkpoint, under the run's criteria (compare.py);
  a save or load that raised fails the layout, with its cause.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .checkpoint_leg import RESUMED_QUANTITIES, SAVED_AFTER, RankCheckpoint
from .compare import Criteria, Measured, measure_steps, merge_rank_diffs, scalar_error, worst

VAL_LOSS_TOLERANCE = 1e-6   # fp32: one forward of the same rows, nothing accumulated over steps


@dataclass
class CheckpointCheck:
    """A layout's leg, merged over ranks and judged."""
    val_loss: float | None                   # relative error
    val_layout: float | None
    val_reference: float | None
    val_bound: float
    resume_same: str | None                  # None: exact; else the first difference, or why not run
    resume_ref: Measured | None
    failures: list[str]

    @property
    def exact(self) -> bool:
        return self.resume_ref is not None and self.resume_same is None

    @property
    def resume_ref_error(self) -> float | None:
        return None if self.resume_ref is None else worst(self.resume_ref.errors.values())

    def as_dict(self) -> dict:
        ref = self.resume_ref
        return {"val_loss": {"error": self.val_loss, "bound": self.val_bound, "layout": self.val_layout,
                             "reference": self.val_reference},
                "resume_same": {"exact": self.exact, "first_difference": self.resume_same},
                "resume_ref": None if ref is None else {"error": self.resume_ref_error, "errors": ref.errors,
                                                        "worst": ref.worst_names, "missing": ref.missing}}


def val_loss_bound(criteria: Criteria, tolerance: float | None) -> float:
    """VAL_LOSS_TOLERANCE in fp32 (--tolerance replaces it, as it replaces the fp32 bound); the loss
    criterion in bf16 (the layout under autocast against the fp32 reference)."""
    if criteria.precision == "fp32":
        return tolerance if tolerance is not None else VAL_LOSS_TOLERANCE
    return criteria.loss_tolerance


def judge(per_rank: Sequence[RankCheckpoint], criteria: Criteria, val_bound: float,
          reference_names) -> CheckpointCheck:
    """Every rank's RankCheckpoint of a layout, merged (the worst over ranks) and judged."""
    first = per_rank[0]
    val_error = None
    if first.val_loss is not None:
        val_error = worst(scalar_error(r.val_loss, r.val_reference) for r in per_rank)
    failures = []
    if val_error is not None and not val_error <= val_bound:
        failures.append(f"val_loss {val_error:.2e} > {val_bound:.1e}")
    if first.error is not None:   # every rank holds the same (CheckpointLeg._agree)
        failures.append(f"checkpoint: {first.error}")
        return CheckpointCheck(val_error, first.val_loss, first.val_reference, val_bound,
                               f"not run ({first.error.split(':')[0]})", None, failures)
    differing = [(RESUMED_QUANTITIES.index(r.first_difference[0]), rank, " ".join(r.first_difference).strip())
                 for rank, r in enumerate(per_rank) if r.first_difference is not None]
    resume_same = None
    if differing:
        _, rank, what = min(differing)
        resume_same = f"{what} on rank {rank}"
        failures.append(f"resume_same: {resume_same} differs from the uninterrupted step {SAVED_AFTER + 1}")
    measured = measure_steps([{q: worst(r.scalars[q] for r in per_rank) for q in first.scalars}],
                             [{s: merge_rank_diffs(r.tensors[s] for r in per_rank) for s in first.tensors}],
                             reference_names)
    failures += [f"resume_ref: {f}" for f in criteria.failures(measured.errors)]
    if measured.missing:
        failures.append(f"resume_ref: no rank holds {', '.join(measured.missing)}")
    return CheckpointCheck(val_error, first.val_loss, first.val_reference, val_bound, resume_same, measured,
                           failures)
