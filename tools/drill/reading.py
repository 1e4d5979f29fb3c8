"""Reading what a run said (tracebacks, resume lines, refusals) and what it left (checkpoints that
verify, metrics.jsonl, loss.png), as the drill judges them."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from gdn_parallel.checkpoint import complete_checkpoints, integrity

from .processes import Finished, attributed

TRACEBACK = "Traceback (most recent call last)"
# torchrun's agent raises these itself when a worker dies or it is signalled; with a kill on purpose
# they are torchrun's report of the kill, not an error of the trainer.
AGENT_REPORTS = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
                 "torch.distributed.elastic.multiprocessing.api.SignalException")
RESUMED = re.compile(r"^resume \| (\S+) \| step (\d+)")
PASSED_OVER = re.compile(r"^resume \| (\S+) fails verification \((.*)\): passed over")
STARTED_AFRESH = "resume | no checkpoint under"
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\)")
ERROR_PREFIX = "gdn-train: error: "
PEER_LOST = re.compile(r"^gdn-train: error: rank (\d+): a collective with the other ranks failed \(")


@dataclass
class TracebackSeen:
    who: str
    exception: str
    excluded: str | None = None   # why it is not counted as raw

    def record(self) -> dict:
        return {"who": self.who, "exception": self.exception[:300], "excluded": self.excluded}


def tracebacks(finished: Finished, killed_on_purpose: bool) -> list[TracebackSeen]:
    """Every traceback in a command's output, with the exception it ended in; torchrun's agent's own
    report of a worker the drill killed is marked excluded."""
    seen: list[TracebackSeen] = []
    for stream in (finished.stdout, finished.stderr):
        open_block: dict[str, bool] = {}
        for who, line in attributed(stream):
            if TRACEBACK in line:
                if open_block.get(who):
                    seen.append(TracebackSeen(who, "(no exception line)"))
                open_block[who] = True
            elif open_block.get(who) and line.strip() and not line[0].isspace():
                open_block[who] = False
                seen.append(TracebackSeen(who, line.strip()))
        seen += [TracebackSeen(who, "(output cut off inside the traceback)")
                 for who, is_open in open_block.items() if is_open]
    for item in seen:
        if (finished.torchrun and killed_on_purpose and item.who == "launcher"
                and item.exception.startswith(AGENT_REPORTS)):
            item.excluded = "torchrun's agent reporting the worker the drill killed"
    return seen


def raw_tracebacks(finished: Finished, killed_on_purpose: bool = False) -> list[dict]:
    return [t.record() for t in tracebacks(finished, killed_on_purpose) if t.excluded is None]


def survivors_said(finished: Finished, ranks: list[int], restart: str | None = None) -> dict[str, dict]:
    """How each rank whose peer the drill killed ended, from a torchrun job's output: its stderr lines
    (tags removed), whether they are exactly the one `rank N: a collective ... failed` line (with the
    restart torchrun makes next, when `restart` is given), and its exit status from torchrun's summary
    (None when torchrun reported none: the job restarted, or the rank ended with status 0)."""
    statuses = {int(rank): int(code) for rank, code in re.findall(
        r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n){0,3}?\s*exitcode\s*:\s*(-?\d+)",
        finished.stderr + finished.stdout)}
    said = {}
    for rank in ranks:
        lines = [line for who, line in attributed(finished.stderr) if who == f"rank {rank}" and line.strip()]
        match = PEER_LOST.match(lines[0]) if len(lines) == 1 else None
        one_line = bool(match and int(match.group(1)) == rank and (restart is None or restart in lines[0]))
        said[f"rank {rank}"] = {"one_line": one_line, "status": statuses.get(rank), "stderr": lines[-4:]}
    return said


@dataclass
class ResumeReport:
    loaded: Path | None            # the checkpoint the run said it resumed
    step: int | None
    afresh: bool                      # "no checkpoint yet: starting from step 0"
    passed_over: list[tuple[Path, str]]


def resume_report(finished: Finished) -> ResumeReport:
    loaded, step, afresh, passed = None, None, False, []
    for line in finished.lines():
        if line.startswith(STARTED_AFRESH):
            afresh = True
        elif (match := PASSED_OVER.match(line)):
            passed.append((Path(match.group(1)), match.group(2)))
        elif (match := RESUMED.match(line)):
            loaded, step = Path(match.group(1)), int(match.group(2))
    return ResumeReport(loaded, step, afresh, passed)


def stderr_lines(finished: Finished) -> list[str]:
    return [line for line in finished.stderr.splitlines() if line.strip()]


def refusal_line(finished: Finished) -> str | None:
    """The trainer's `gdn-train: error:` line (the last on stderr), else None."""
    lines = stderr_lines(finished)
    return lines[-1] if lines and lines[-1].startswith(ERROR_PREFIX) else None


def refused_in_one_line(finished: Finished) -> bool:
    """stderr is exactly the error line (nothing else printed there: no warning, no traceback)."""
    return refusal_line(finished) is not None and len(stderr_lines(finished)) == 1


def damage_of(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint against its checksums.json (None: it verifies)."""
    try:
        recorded = integrity.read_manifest(checkpoint)
    except ValueError as err:
        return str(err)
    if recorded is None:
        return "no checksums.json"
    found = integrity.find_damage(checkpoint, sorted(recorded), recorded)
    return str(found[0]) if found else None


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def newest_complete(out_dir: Path) -> Path | None:
    found = complete_checkpoints(str(out_dir))
    return found[-1] if found else None


def final_checkpoint_ok(out_dir: Path, steps: int) -> tuple[bool, str]:
    final = out_dir / "checkpoints" / f"step_{steps}"
    if final not in complete_checkpoints(str(out_dir)):
        return False, f"{final} missing or incomplete"
    problem = damage_of(final)
    return problem is None, problem or "verifies"


def written_since(out_dir: Path, since: float) -> list[Path]:
    """The complete checkpoints under out_dir (those set aside in checkpoints/abandoned/ too) sealed after
    `since` (COMPLETE's time; a copy of a base run keeps the base's): the ones a trial's commands wrote."""
    return sorted(marker.parent for marker in (out_dir / "checkpoints").glob("**/COMPLETE")
                  if marker.stat().st_mtime >= since)


def non_finite_checkpoints(out_dir: Path, since: float) -> list[str]:
    """Each checkpoint written since `since` that holds a tensor that is not finite, or that cannot be
    read as the converters read it (verified, without running code): 'path: why'."""
    import torch

    from gdn_parallel.convert.dcp_io import read_tensors, tensor_entries
    found = []
    for checkpoint in written_since(out_dir, since):
        try:
            entries = tensor_entries(checkpoint)
            tensors = read_tensors(checkpoint, entries, list(entries))
        except Exception as err:   # the drill reports it; the trial goes on
            found.append(f"{checkpoint}: unreadable ({type(err).__name__}: {err})")
            continue
        bad = sorted(key for key, value in tensors.items()
                     if value.is_floating_point() and not bool(torch.isfinite(value).all()))
        if bad:
            found.append(f"{checkpoint}: not finite: {', '.join(bad[:3])}")
    return found


def summary_of(out_dir: Path) -> dict | None:
    """The last run's summary record of metrics.jsonl (a line torn by a kill is skipped, as the
    trainer's own reader does)."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "summary" in record:
            found = record["summary"]
    return found


def metrics_intact(out_dir: Path) -> tuple[bool, str]:
    path = out_dir / "metrics.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, ValueError) as err:
        return False, f"metrics.jsonl: {type(err).__name__}: {err}"
    if not records or not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in records):
        return False, "metrics.jsonl: empty or a record without its step"
    return True, f"{len(records)} records"


def png_intact(path: Path) -> tuple[bool, str]:
    if not path.is_file():
        return False, f"{path.name} missing"
    data = path.read_bytes()
    whole = data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82")
    partial_left = path.with_name(path.name + ".partial").exists()
    return whole and not partial_left, f"{len(data)} bytes, {'whole' if whole else 'TORN'}" + \
        (", a .partial left beside it" if partial_left else "")
