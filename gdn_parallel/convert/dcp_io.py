"""Our checkpoints (gdn_parallel/checkpoint) read and written by one process, without a process group.

Reading: the tensor entries of the DCP metadata become empty tensors of their global shape, which
`dcp.load(..., no_dist=True)` fills (public API in torch 2.11 to 2.14; DCP assembles the pieces any
layout wrote). Writing a checkpoint made from weights alone (from-hf, from-torch): the model tensors
under `model.<name>`, AdamW slots as a fresh optimizer has them after no step (zero moments, step 0:
the first update is exactly a fresh AdamW's), and the trainer's own record of a checkpoint at step 0
(checkpoint.manager.seal: the config, the layout of one process, the data stream at its start), all
under a temporary name.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoint import CheckpointError, latest_checkpoint, read_trainer_state
from ..checkpoint.files import CHECKPOINTS, COMPLETE, TRAINER_STATE, is_complete
from ..checkpoint.loading import verify
from ..checkpoint.manager import checkpoint_record, seal
from ..checkpoint.reading import SafeFileSystemReader, TensorsOnlyLoadPlanner, read_metadata
from ..checkpoint.state import MODEL, OPTIM
from ..config import Config
from .atomic import new_directory
from .errors import ConvertError

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


@contextlib.contextmanager
def _one_process():
    """DCP warns that it assumes one process whenever no_dist is on: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore",
                                message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory, or a run's out_dir (its newest complete checkpoint)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        if not is_complete(path):
            raise ConvertError(f"{path} is not a complete checkpoint (no {COMPLETE} marker or "
                               f"{TRAINER_STATE}: an interrupted save?); take a complete step_<N> directory")
        return path
    if path.is_dir():
        newest = latest_checkpoint(str(path))
        if newest is not None:
            return newest
    raise ConvertError(f"{path} {_what_it_is(path)}: give a checkpoint directory (holding .metadata, "
                       f"{TRAINER_STATE} and {COMPLETE}, e.g. <out_dir>/checkpoints/step_200) or a run's "
                       f"out_dir")


def _what_it_is(path: Path) -> str:
    if not path.exists():
        return "does not exist"
    if (path / CHECKPOINTS).is_dir():
        found = sorted(p.name for p in (path / CHECKPOINTS).iterdir())
        return f"holds no complete checkpoint (its {CHECKPOINTS}/ has {found or 'nothing'})"
    if (path / "config.json").is_file():
        return "is a Hugging Face folder, not a gdn_parallel checkpoint (from-hf converts it into one)"
    return "is not a gdn_parallel checkpoint"


def tensor_entries(path: Path) -> dict[str, TensorStorageMetadata]:
    """key -> global shape and dtype of every tensor in the checkpoint, once it verifies against its
    checksums; its index is read without running code, and its data files must all exist."""
    problem = verify(path, fix="the converters read only checkpoints with checksums: resume it in the "
                               "trainer with --set checkpoint.verify=false and convert the checkpoint it "
                               "writes")
    if problem is not None:
        raise CheckpointError(f"{path} fails verification: {problem}; take another checkpoint")
    metadata = read_metadata(path)
    data_files = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()} - {None}
    missing = sorted(name for name in data_files if not (path / name).is_file())
    if missing:
        raise ConvertError(f"{path} is missing data file(s) {missing} that its .metadata lists; copy the "
                           f"whole checkpoint directory")
    return dict(metadata.state_dict_metadata)


def read_tensors(path: Path, entries: dict[str, TensorStorageMetadata],
                 keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The whole (single-device) tensors of `keys`, however many processes wrote them."""
    targets = {key: torch.empty(entries[key].size, dtype=entries[key].properties.dtype) for key in keys}
    if targets:
        with _one_process():
            dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)),
                     planner=TensorsOnlyLoadPlanner(), no_dist=True)
    return targets


def read_model(path) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """(checkpoint, model tensors by single-device name, trainer state) of a checkpoint or run directory."""
    checkpoint = resolve_checkpoint(path)
    saved = read_trainer_state(checkpoint)
    if not isinstance(saved.get("config", {}).get("model"), dict):
        raise ConvertError(f"{checkpoint}/{TRAINER_STATE} holds no config.model; it was not written by "
                           f"gdn_parallel's trainer or converter")
    entries = tensor_entries(checkpoint)
    model_keys = [key for key in entries if key.startswith(MODEL)]
    tensors = read_tensors(checkpoint, entries, model_keys)
    return checkpoint, {key[len(MODEL):]: value for key, value in tensors.items()}, saved


def fresh_optimizer_slots(model_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AdamW's state before its first step, in the layout-free form (fp32, the trainer's parameters)."""
    slots = {}
    for name, tensor in model_tensors.items():
        for moment in ADAMW_MOMENTS:
            slots[f"{OPTIM}{name}.{moment}"] = torch.zeros(tensor.shape, dtype=torch.float32)
        slots[f"{OPTIM}{name}.step"] = torch.tensor(0.0)
    return slots


def write_checkpoint(out: Path, model_tensors: dict[str, torch.Tensor], config: Config, data_stream: dict,
                     source: dict | None = None, attachments: dict[str, bytes] | None = None) -> Path:
    """A step-0 checkpoint at `out` that the trainer resumes from under any layout (its files beside
    the tensors, `attachments` too (the data's tokenizer), are written by the trainer's own writer,
    checkpoint.manager.seal)."""
    state = {f"{MODEL}{name}": tensor for name, tensor in model_tensors.items()}
    state.update(fresh_optimizer_slots(model_tensors))
    record = checkpoint_record(0, config, 1, data_stream, **({"converted_from": source} if source else {}))
    with new_directory(Path(out)) as partial:
        with _one_process():
            dcp.save(state, storage_writer=FileSystemWriter(str(partial)), no_dist=True)
        seal(partial, record, config, attachments=attachments)
    return Path(out)
