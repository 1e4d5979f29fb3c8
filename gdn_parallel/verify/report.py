"""The table rank 0 prints and the JSON file it writes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .compare import QUANTITIES
from .runner import Verification

COLUMNS = (("loss", "loss"), ("grad_norm", "grad norm"), ("grads", "grads"), ("grads_all", "all grads"),
           ("params", "params"), ("params_all", "all params"))
NAME_WIDTH = 24
# --checkpoint (checkpoint_leg.py): the evaluation's relative error, the reference resumed from the
# layout's checkpoint (worst relative error), the same layout resumed (bit-exact or not)
CHECKPOINT_COLUMNS = ("val loss", "resume ref", "resume same")


def default_json_path() -> str:
    """$OUT/verify.json when $OUT is set (a job's output folder), else runs/verify.json."""
    return os.path.join(os.environ.get("OUT") or "runs", "verify.json")


def _row(name: str, errors: dict, verdict: str, extra: tuple = ()) -> str:
    cells = "".join(f"{errors[q]:>11.2e}" if q in errors else f"{'-':>11}" for q, _ in COLUMNS)
    cells += "".join(f"{cell:>12}" for cell in extra)
    return f"{name:<{NAME_WIDTH}}{cells}  {verdict}"


def _error_cell(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def _checkpoint_cells(check) -> tuple:
    if check.resume_ref is None:
        same = "-"
    else:
        same = "exact" if check.resume_same is None else "DIFFERS"
    return _error_cell(check.val_loss), _error_cell(check.resume_ref_error), same


def _checkpoint_bounds(result: Verification) -> tuple:
    """The val loss bound; the resume ref bound where every quantity has the same one (fp32)."""
    bounds = {result.criteria.bound(q) for q in QUANTITIES}
    return (_error_cell(result.val_loss_bound), _error_cell(bounds.pop()) if len(bounds) == 1 else "-",
            "exact")


def table(result: Verification) -> list[str]:
    """Layout | worst relative error per quantity over the steps | verdict; failures explained below."""
    checkpoint = result.val_loss_bound is not None
    titles = "".join(f"{title:>11}" for _, title in COLUMNS)
    titles += "".join(f"{title:>12}" for title in CHECKPOINT_COLUMNS) if checkpoint else ""
    header = f"{'layout':<{NAME_WIDTH}}" + titles + "  result"
    lines = [header, "-" * len(header)]
    if result.baseline is not None:
        lines.append(_row("(bf16 on one device)", result.baseline.errors, "baseline",
                          ("-",) * len(CHECKPOINT_COLUMNS) if checkpoint else ()))
    lines.append(_row("(bounds)", {q: result.criteria.bound(q) for q in QUANTITIES}, "",
                      _checkpoint_bounds(result) if checkpoint else ()))
    for r in result.results:
        if r.status == "skipped":
            lines.append(f"{r.layout.name:<{NAME_WIDTH}}skipped: {r.reason}")
        else:
            lines.append(_row(r.layout.name, r.measured.errors,
                              r.status.upper() if r.status == "fail" else r.status,
                              _checkpoint_cells(r.checkpoint) if r.checkpoint is not None else ()))
    counts = {s: sum(r.status == s for r in result.results) for s in ("pass", "fail", "skipped")}
    lines.append(f"{len(result.results)} layouts: {counts['pass']} passed, {counts['fail']} failed, "
                 f"{counts['skipped']} skipped")
    for r in result.results:
        if r.status == "fail":
            where = ", ".join(f"{q}: {n}" for q, n in r.measured.worst_names.items() if n)
            lines.append(f"FAILED {r.layout.name}: {r.reason}" + (f" (worst {where})" if where else ""))
    return lines


def to_json(result: Verification, header: dict) -> dict:
    def measured(m):
        if m is None:
            return None
        return {"errors": m.errors, "worst": m.worst_names, "per_step": m.per_step, "missing": m.missing,
                "judged_against_the_set": m.noise_judged}
    return {
        **header,
        "torch": torch.__version__,
        "criteria": result.criteria.as_dict(),
        "reference": {"first_loss": result.reference_loss, "seconds": result.reference_seconds},
        "bf16_one_device": measured(result.baseline),
        "passed": result.passed,
        "finished": result.finished,   # false: the run stopped part-way (the layouts it finished are here)
        "layouts": [{**r.layout.as_dict(), "status": r.status, "reason": r.reason, "seconds": r.seconds,
                     **(measured(r.measured) or {}), **(r.checkpoint.as_dict() if r.checkpoint else {})}
                    for r in result.results],
    }


def write_json(data: dict, path: str | None) -> Path:
    target = Path(path or default_json_path())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float) + "\n", encoding="utf-8")
    tmp.replace(target)
    return target
