"""Finding and loading a checkpoint that may be damaged or come from elsewhere.

Before anything is loaded, a checkpoint is verified against the checksums recorded when it was
written (integrity.py; each rank checks a share of the files), its index is read without running
code (reading.py) and must hold every tensor the model and optimizer need, at their shapes. Every
refusal is a CheckpointError that names the file and the newest checkpoint that verifies, raised on
every rank alike (a collective). `--resume auto` passes over checkpoints that fail verification,
saying so, and takes the newest that passes. A file linked out of the checkpoint's directory fails
verification whatever its checksums say. Whose run a checkpoint continues is `run_identity`: the run
id it records against the one <train.out_dir>/run_id.json names.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..config import Config, ConfigError, ModelConfig
from ..model import architecture_differences
from . import files, integrity, ranks
from .errors import CheckpointDeviceError, CheckpointError, CheckpointOfAnotherRun, CheckpointUnreadable
from .reading import (
    SafeFileSystemReader,
    TensorsOnlyLoadPlanner,
    load_tensors_file,
    read_metadata,
    unreadable_tensors,
)
from .state import apply_loaded, targets_to_load


def _is_data(name: str) -> bool:
    return name.endswith(".distcp")


def _local_damage(path: Path, recorded: dict[str, dict] | None, data: bool) -> str | None:
    """The first problem in this rank's share of the checkpoint's files: the small ones (index, state,
    RNG, config), or the tensor data files (`data`)."""
    if recorded is None:
        return None
    names = [name for name in sorted(recorded) if _is_data(name) == data]
    damage = integrity.find_damage(Path(path), names[ranks.rank()::ranks.world()], recorded)
    return str(damage[0]) if damage else None


def _first(problem: str | None) -> str | None:
    """The lowest rank's problem, the same on every rank (a collective)."""
    found = [p for p in ranks.gathered(problem) if p]
    return found[0] if found else None


def _manifest(path: Path) -> tuple[dict[str, dict] | None, str | None]:
    try:
        return integrity.read_manifest(path), None
    except ValueError as err:   # every rank reads the same file: the same answer everywhere
        return None, str(err)


UNVERIFIED_FIX = "if you trust it, --set checkpoint.verify=false loads it unverified"


def verify(path: Path, data: bool = True, unverified_ok: bool = False,
           fix: str = UNVERIFIED_FIX) -> str | None:
    """None when checkpoint `path` matches its recorded checksums, else what is wrong, e.g.
    "__1_0.distcp: checksum mismatch (...)". A file that is a symbolic link out of the checkpoint is
    wrong whatever the checksums say (files.links_out_of). A checkpoint that records none (deleted,
    or written before checksums existed) is wrong too, unless `unverified_ok`; `fix` says how to accept it.
    `data=False` checks all but the tensor data files (quick: what is read before the tensors). A
    collective."""
    links = files.links_out_of(Path(path))
    if links:
        name, target = links[0]
        return (f"{name}: a symbolic link to {target}, outside the checkpoint directory; a checkpoint's "
                f"files are read only from inside it: copy the file itself in (cp -L) if you trust it")
    recorded, problem = _manifest(path)
    if problem is not None:
        return problem
    if recorded is None and not unverified_ok:
        return (f"{integrity.MANIFEST}: missing, so none of its files can be verified (deleted, or written "
                f"before checkpoints had checksums); {fix}")
    return _first(_local_damage(path, recorded, data=False)) or (
        _first(_local_damage(path, recorded, data=True)) if data else None)


def nothing_verifies(out_dir: str) -> CheckpointError:
    count = len(files.complete_checkpoints(out_dir))
    return CheckpointError(f"--resume auto: none of the {count} checkpoint(s) under "
                           f"{files.checkpoints_dir(out_dir)} verifies (listed above); restore one from a "
                           f"copy, or start a new run in another train.out_dir")


class CheckpointDamaged(CheckpointError):
    """The data of a checkpoint fails verification or cannot be read safely (found while it was being
    loaded: its checksums may have been rewritten with it)."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path} fails verification: {problem}; {_alternative(Path(path))}")


def newest_verifying(out_dir: Path, before: int | None = None, unverified_ok: bool = False) -> Path | None:
    """The newest complete checkpoint under out_dir (older than step `before`) that verifies."""
    for path in reversed(files.complete_checkpoints(str(out_dir))):
        step = files.step_of(path)
        if step is None:  # complete_checkpoints lists step_<N> directories only
            raise CheckpointError(f"{path} is listed as a checkpoint but is not a step_<N> directory")
        if before is not None and step >= before:
            continue
        if verify(path, unverified_ok=unverified_ok) is None:
            return path
    return None


def resolve_resume(resume: str | None, out_dir: str, say: Callable[[str], None] = lambda line: None,
                   unverified_ok: bool = False) -> Path | None:
    """`--resume auto`: the newest complete checkpoint under out_dir whose small files verify (None
    when there is none yet; every newer step directory passed over is named with `say`, and why);
    `--resume PATH`: that checkpoint, which must be complete and verify so. Its data files are
    verified by `load`. `unverified_ok`: a checkpoint without checksums is taken (said with `say`).
    A collective (verification)."""
    if not resume:
        return None
    if resume == "auto":
        if not out_dir:
            raise ConfigError("--resume auto looks for checkpoints under train.out_dir, which is empty; set "
                              "train.out_dir (or give --resume PATH)")
        found = files.complete_checkpoints(out_dir)
        for path in reversed(files.step_directories(out_dir)):
            if path not in found:
                say(f"resume | {path} is not a complete checkpoint ({files.incomplete_reason(path)}): "
                    f"passed over")
                continue
            problem = _small_files_problem(path, unverified_ok)
            if problem is None:
                _say_if_unverified(path, say)
                return path
            say(f"resume | {path} fails verification ({problem}): passed over")
        if found:
            raise nothing_verifies(out_dir)
        return None
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"--resume {resume}: no such checkpoint directory")
    if not files.is_complete(path):
        raise ConfigError(f"--resume {resume}: not a complete checkpoint (no {files.COMPLETE} marker or "
                          f"{files.TRAINER_STATE}: an interrupted save?); use --resume auto or another step")
    problem = _small_files_problem(path, unverified_ok)
    if problem is not None:
        raise CheckpointError(f"--resume {resume} fails verification: {problem}; {_alternative(path)}")
    _say_if_unverified(path, say)
    return path


def _say_if_unverified(path: Path, say: Callable[[str], None]) -> None:
    if _manifest(path) == (None, None):
        say(f"resume | {path} has no {integrity.MANIFEST}: loaded unverified (checkpoint.verify=false)")


def _small_files_problem(path: Path, unverified_ok: bool = False) -> str | None:
    """What is wrong with a checkpoint's small files: checksums, then the trainer state and index read
    as resuming reads them (a forger rewrites the checksums); None when they pass. The data files are
    verified while they load."""
    problem = verify(path, data=False, unverified_ok=unverified_ok)
    if problem is not None:
        return f"{path}/{problem}"
    try:
        read_trainer_state(path)
        read_metadata(path)
    except CheckpointUnreadable as err:
        return str(err)
    return None


def whole_problem(path: Path, unverified_ok: bool = False) -> str | None:
    """What is wrong with checkpoint `path` anywhere, None when nothing is: its small files as
    `resolve_resume` checks them, the checksums of its data files, and its RNG states and every tensor
    read as a load reads them (one at a time, without the model). For a checkpoint that would end its
    run, which nothing else reads: a damaged one must not pass for a finished run. A collective."""
    problem = _small_files_problem(path, unverified_ok)
    if problem is not None:
        return problem
    recorded, _ = _manifest(path)
    damage = _first(_local_damage(path, recorded, data=True))
    return f"{path}/{damage}" if damage else _first(_unreadable_share(Path(path)))


def _unreadable_share(path: Path) -> str | None:
    """The first RNG or data file of this rank's share that cannot be read as resuming reads it."""
    for file in sorted(path.glob("rng_rank*.pt"))[ranks.rank()::ranks.world()]:
        try:
            _read_rng(file)
        except CheckpointError as err:
            return str(err)
    names = sorted({info.relative_path for info in read_metadata(path).storage_data.values()})
    return unreadable_tensors(path, set(names[ranks.rank()::ranks.world()]))


def pass_over(path: Path, problem: str, out_dir: str, say: Callable[[str], None],
              unverified_ok: bool = False) -> Path:
    """Under --resume auto: say that checkpoint `path` is passed over and why, and return the newest
    earlier checkpoint that verifies (refused when there is none). A collective."""
    say(f"resume | {path} fails verification ({problem}): passed over")
    older = newest_verifying(Path(out_dir), before=files.step_of(path), unverified_ok=unverified_ok)
    if older is None:
        raise nothing_verifies(out_dir)
    return older


def _alternative(path: Path) -> str:
    """Where to resume instead of a damaged checkpoint of a run: the newest earlier one that verifies."""
    step = files.step_of(path)
    if step is None or path.parent.name != files.CHECKPOINTS:
        return "take another checkpoint"
    newest = newest_verifying(path.parent.parent, before=step)
    return (f"the newest earlier checkpoint that verifies is {newest} (--resume {newest})"
            if newest is not None else f"no earlier checkpoint of {path.parent.parent} verifies")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of checkpoint `path`, checked for the entries resuming reads."""
    file = Path(path) / files.TRAINER_STATE
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointUnreadable(f"{file} cannot be read as JSON ({type(err).__name__}: {err}); the "
                                   f"checkpoint is damaged: take another one") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("step"), int)
            and isinstance(saved.get("config"), dict)
            and isinstance(saved.get("data", {}).get("stream"), dict)):
        raise CheckpointUnreadable(f"{file} lacks the step, config or data position a gdn_parallel "
                                   f"checkpoint records")
    return saved


def check_compatible(saved: dict[str, Any], config: Config) -> None:
    """The model a checkpoint holds must be the configured one: the same resolved architecture
    (model/architecture.py, the converters' rule), so what does not decide the weights may differ
    (implementations, the GDN chunk size, init; the attention fields of a model without attention).
    Names every differing setting."""
    saved_fields = saved.get("config", {}).get("model", {})
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:  # a field the package no longer has decides nothing here; one it gained takes its default
        saved_model = Config.from_dict({"model": {k: v for k, v in saved_fields.items() if k in known}}).model
    except ConfigError as err:
        raise ConfigError(f"the checkpoint's model config cannot be read here ({err}); resume with the "
                          f"package version that saved it or start a new train.out_dir") from None
    differing = architecture_differences(saved_model, config.model)
    if differing:
        details = ", ".join(f"{key}: checkpoint {a!r}, config {b!r}" for key, (a, b) in differing.items())
        raise ConfigError(f"the checkpoint holds another model ({details}); resume with the config it was "
                          f"saved with (its config.yaml) or start a new train.out_dir")


def checkpoint_run_id(path: Path) -> str | None:
    """The run id checkpoint `path` records (trainer_state.json), None for one written before runs had
    ids or by a converter."""
    run_id = read_trainer_state(path).get("run_id")
    if run_id is not None and not (isinstance(run_id, str) and run_id):
        raise CheckpointUnreadable(f"{Path(path) / files.TRAINER_STATE}: run_id {run_id!r} is not a run id; "
                                   f"the checkpoint is damaged: take another one")
    return run_id


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """The run a train.out_dir holds, as a start or resume settles it (run_identity)."""
    run_id: str
    resumed_from_run: str | None = None   # the other run whose checkpoint this run continues
    new_record: dict | None = None        # run_id.json to write (the out_dir had none)
    said: str = ""                        # what the resume line adds ('' : nothing to say)

    def checkpoint_entries(self) -> dict[str, str]:
        """What every checkpoint of the run records of it (trainer_state.json)."""
        return {"run_id": self.run_id,
                **({"resumed_from_run": self.resumed_from_run} if self.resumed_from_run else {})}


NO_RUN_ID = "the checkpoint records no run id (written before runs had ids, or by a converter)"


def run_identity(out_dir: str, checkpoint: Path | None, allow_other_run: bool = False,
                 resume: str | None = None) -> RunIdentity:
    """Whose run continues in train.out_dir from `checkpoint` (None: a start from step 0). The out_dir's
    run id is <out_dir>/run_id.json; an out_dir without one (a fresh one) gets a new id, whatever
    checkpoint it starts from. A checkpoint of the out_dir's run, of the run it began from, or without
    a run id resumes; another run's is refused (CheckpointOfAnotherRun: a step directory copied, linked
    or replaced from another run's out_dir), unless `allow_other_run`. Reads only; nothing is written."""
    if not out_dir:   # nothing to compare with, and no checkpoint is saved
        return RunIdentity(files.new_run_id())
    ours = files.read_run_record(out_dir)
    theirs = checkpoint_run_id(checkpoint) if checkpoint is not None else None
    if ours is None:
        return _new_run(out_dir, checkpoint, theirs)
    run_id, origin = ours["run_id"], ours.get("resumed_from_run")
    if checkpoint is None or theirs == run_id:
        return RunIdentity(run_id, origin)
    if theirs is None:
        return RunIdentity(run_id, origin, said=f"{NO_RUN_ID}: resumed as run {run_id}")
    if theirs == origin:
        return RunIdentity(run_id, origin, said=f"a checkpoint of run {theirs}, which this train.out_dir's "
                                                f"run {run_id} began from: resumed as run {run_id}")
    if allow_other_run:
        return RunIdentity(run_id, theirs, said=f"a checkpoint of another run, {theirs}: resumed into run "
                                                f"{run_id} (checkpoint.allow_other_run=true)")
    raise _other_run_refusal(out_dir, checkpoint, theirs, run_id, resume)


def _new_run(out_dir: str, checkpoint: Path | None, theirs: str | None) -> RunIdentity:
    """The identity of a run whose out_dir has no run id yet: a new id, and the run it began from."""
    run_id = files.new_run_id()
    record = {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if checkpoint is None:
        return RunIdentity(run_id, new_record=record)
    file = files.run_id_file(out_dir)
    if theirs is None:
        return RunIdentity(run_id, new_record=record, said=f"{NO_RUN_ID}: continued as run {run_id}, new "
                                                           f"in this train.out_dir ({file})")
    record.update(resumed_from_run=theirs, resumed_from=str(checkpoint))
    said = f"a checkpoint of run {theirs}: continued as run {run_id}, new in this train.out_dir ({file})"
    return RunIdentity(run_id, theirs, record, said)


def _other_run_refusal(out_dir: str, checkpoint: Path, theirs: str, run_id: str,
                       resume: str | None) -> CheckpointOfAnotherRun:
    """The one-line refusal of another run's checkpoint: both ids, where it points, and the ways on."""
    link = (f"; {checkpoint} is a symbolic link to {Path(checkpoint).resolve()}"
            if Path(checkpoint).is_symlink() else "")
    own = [path for path in files.complete_checkpoints(out_dir) if _run_id_or_none(path) == run_id]
    newest = f"; this run's newest checkpoint is {own[-1]} (--resume {own[-1]})" if own else ""
    how = "--resume auto: " if resume == "auto" else ""
    return CheckpointOfAnotherRun(
        f"{how}{checkpoint} is a checkpoint of another run: it records run id {theirs}, this "
        f"train.out_dir's run is {run_id} ({files.run_id_file(out_dir)}){link}. Resumed here it would "
        f"continue this run from another run's state (a step directory copied or linked in from another "
        f"run, or a path to one): set --set checkpoint.allow_other_run=true to do that on purpose, or "
        f"resume it into a new train.out_dir{newest}")


def _run_id_or_none(path: Path) -> str | None:
    try:
        return checkpoint_run_id(path)
    except CheckpointError:   # a damaged checkpoint is no run's newest
        return None


def _check_index(path: Path, targets: dict[str, torch.Tensor]) -> None:
    """Every tensor to load is in the checkpoint's index at its global shape (else name them)."""
    entries = read_metadata(path).state_dict_metadata
    missing = sorted(key for key in targets if key not in entries)
    if missing:
        named = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise CheckpointUnreadable(f"{path}/{'.metadata'} lacks {len(missing)} tensor(s) the run needs "
                                   f"({named}); the checkpoint is incomplete: take another one")
    wrong = [f"{key}: {_saved_shape(entries[key])} saved, {tuple(t.shape)} here" for key, t in targets.items()
             if _saved_shape(entries[key]) != tuple(t.shape)]
    if wrong:
        raise CheckpointError(f"{path} holds tensors of other shapes ({'; '.join(wrong[:3])}); it is not a "
                              f"checkpoint of this model")


def _saved_shape(entry: TensorStorageMetadata | BytesStorageMetadata) -> tuple[int, ...] | str:
    """The global shape an index entry records; an entry saved as bytes (no tensor) says so."""
    return tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "no tensor (bytes)"


def load(path: Path, named_params: list[tuple[str, nn.Parameter]], optimizer, dims, config: Config,
         same_layout: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Load checkpoint `path` into this rank's parameters and optimizer; returns its trainer state.
    The RNG states are restored when the layout is the same (same ranks). A collective.

    The tensor data files are verified while DCP reads them (a thread, this rank's share of the
    files): whichever reads a page first brings it into the page cache for the other. Verifying
    first made a cold load of a 1.3B checkpoint (14.8 GiB, H100 host) 20% slower, alongside 0.9%
    (docs/reliability.md). Raises CheckpointDamaged when they do not verify; what
    was loaded is then not to be used (the caller loads another checkpoint or stops)."""
    problem = verify(path, data=False, unverified_ok=not config.checkpoint.verify)
    if problem is not None:
        raise CheckpointDamaged(path, problem)
    recorded, _ = _manifest(path)
    try:
        saved = read_trainer_state(path)
        check_compatible(saved, config)
        targets = targets_to_load(named_params, optimizer, dims)
        _check_index(Path(path), targets)
    except CheckpointUnreadable as err:  # its checksums match (rewritten with it?): unreadable all the same
        raise CheckpointDamaged(path, str(err)) from None
    failure = None
    with ThreadPoolExecutor(1) as pool:
        checking = pool.submit(_local_damage, path, recorded, True)
        try:
            dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)),
                     planner=TensorsOnlyLoadPlanner())
        except (Exception, CheckpointException) as err:   # DCP raises on every rank, with every rank's cause
            failure = err
        problem = _first(checking.result())
    if problem is not None:
        raise CheckpointDamaged(path, problem)
    device_error = _device_error(failure)
    if device_error is not None:   # the files are intact: no older checkpoint is the fix
        raise CheckpointDeviceError(f"loading {path}: {device_error}") from None
    if failure is not None:  # its checksums match (rewritten with it?): unreadable all the same
        raise CheckpointDamaged(path, ranks.describe(failure)) from None
    apply_loaded(named_params, optimizer, targets)
    # The generators continue where they were under the same ranks; converted checkpoints have none.
    rng_file = Path(path) / f"rng_rank{ranks.rank()}.pt"
    restore = same_layout(saved) and rng_file.is_file()
    ranks.agree(lambda: set_rng_state(_read_rng(rng_file)) if restore else None,
                lambda problem: CheckpointDamaged(path, problem))
    return saved


def _device_error(failure: BaseException | None) -> str | None:
    """The device error a failed load carries (CheckpointDeviceError, on this rank or, wrapped by DCP,
    on any), or None."""
    if isinstance(failure, CheckpointDeviceError):
        return str(failure)
    if isinstance(failure, CheckpointException):
        for rank, (error, _trace) in sorted(failure.failures.items()):
            if isinstance(error, CheckpointDeviceError):
                return f"on rank {rank}: {error}"
    return None


def _read_rng(file: Path) -> dict:
    """A rank's RNG states, read as plain data and tensors (torch's weights_only loader)."""
    try:
        state = load_tensors_file(file)
    except Exception as err:
        raise CheckpointError(f"{file} is not an RNG state file that can be read safely "
                              f"({ranks.describe(err)})") from None
    ok = (isinstance(state, dict) and isinstance(state.get("torch"), torch.Tensor)
          and isinstance(state.get("python"), tuple))
    if not ok:
        raise CheckpointError(f"{file} does not hold the torch and python RNG states")
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    try:
        random.setstate(state["python"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"the saved Python RNG state is malformed ({err})") from None
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
