"""The table rank 0 prints and the JSON file it writes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import torch

from .compare import QUANTITIES
from .runner import Verification

COLUMNS = (("loss", "loss"), ("grad_norm", "grad norm"), ("grads", "grads"), ("grads_all", "all grads"),
           ("params", "params"), ("params_all", "all params"))
NAME_WIDTH = 24


def default_json_path() -> str:
    """$OUT/verify.json when $OUT is set (a job's output folder), else runs/verify.json."""
    return os.path.join(os.environ.get("OUT") or "runs", "verify.json")


def _row(name: str, errors: dict, verdict: str) -> str:
    cells = "".join(f"{errors[q]:>11.2e}" if q in errors else f"{'-':>11}" for q, _ in COLUMNS)
    return f"{name:<{NAME_WIDTH}}{cells}  {verdict}"


def table(result: Verification) -> List[str]:
    """Layout | worst relative error per quantity over the steps | verdict; failures explained below."""
    header = f"{'layout':<{NAME_WIDTH}}" + "".join(f"{title:>11}" for _, title in COLUMNS) + "  result"
    lines = [header, "-" * len(header)]
    if result.baseline is not None:
        lines.append(_row("(bf16 on one device)", result.baseline.errors, "baseline"))
    lines.append(_row("(bounds)", {q: result.criteria.bound(q) for q in QUANTITIES}, ""))
    for r in result.results:
        if r.status == "skipped":
            lines.append(f"{r.layout.name:<{NAME_WIDTH}}skipped: {r.reason}")
        else:
            lines.append(_row(r.layout.name, r.measured.errors, r.status.upper() if r.status == "fail" else r.status))
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
        "layouts": [{**r.layout.as_dict(), "status": r.status, "reason": r.reason, "seconds": r.seconds,
                     **(measured(r.measured) or {})} for r in result.results],
    }


def write_json(data: dict, path: Optional[str]) -> Path:
    target = Path(path or default_json_path())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float) + "\n", encoding="utf-8")
    tmp.replace(target)
    return target
