"""Reading a checkpoint that may come from anywhere without running code from it.

torch.distributed.checkpoint keeps its index in `.metadata`, a pickle, and would unpickle a
non-tensor entry with `torch.load(weights_only=False)`: a checkpoint from a shared bucket or a hub
could run anything on `--resume`. Here the index is unpickled by an unpickler that admits only the
classes DCP's index is made of (`METADATA_GLOBALS`), and then checked for the form our checkpoints
have: every entry a tensor, every data file a plain file name inside the checkpoint, no storage
transforms. Tensor data itself is read by DCP with `torch.load(weights_only=True)`, and a planner
that refuses non-tensor items keeps it that way. Every failure is a CheckpointError naming the file.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .errors import CheckpointDeviceError, CheckpointError, CheckpointUnreadable
from .files import resolves_outside
from .ranks import describe

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                         "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                         "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),     # a layout by its name, e.g. "torch.strided"
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


@contextlib.contextmanager
def quiet_tensor_loader():
    """torch's weights_only loader warns on stderr about a pickle protocol it did not write (any planted
    pickle): the refusal that follows says what matters, in one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield


def load_tensors_file(path, **kwargs) -> Any:
    """torch.load of a file that may come from anywhere: tensors and plain data only (weights_only)."""
    with quiet_tensor_loader():
        return torch.load(path, weights_only=True, **kwargs)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a checkpoint index does not hold "
                                     f"(loading it could run code)")


def read_metadata(path) -> Metadata:
    """The DCP index of checkpoint `path`, read without running code and checked (module docstring)."""
    file = Path(path) / METADATA_FILE
    try:
        data = file.read_bytes()
    except OSError as err:
        raise CheckpointUnreadable(f"{file} cannot be read ({err.strerror or err}); the checkpoint is "
                                   f"incomplete: copy the whole directory or take another "
                                   f"checkpoint") from None
    try:
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # a torn file ends in any of several errors: name the file, not the pickle
        raise CheckpointUnreadable(f"{file} is not a checkpoint index that can be read safely "
                                   f"({type(err).__name__}: {err}); the file is damaged or was not written "
                                   f"by torch.distributed.checkpoint") from None
    _check_form(metadata, file)
    return metadata


def _check_form(metadata: Any, file: Path) -> None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointUnreadable(f"{file} does not hold a torch.distributed.checkpoint index")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointUnreadable(f"{file}: entry {key!r} is a {type(entry).__name__}, not a tensor; "
                                       f"gdn_parallel checkpoints hold tensors only (other entries would "
                                       f"be unpickled)")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointUnreadable(f"{file} has no storage table")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _DATA_FILE.match(name):
            raise CheckpointUnreadable(f"{file} points at the data file {name!r}; only __<rank>_<n>.distcp "
                                       f"files inside the checkpoint are read")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointUnreadable(f"{file} asks for storage transforms {info.transform_descriptors}; "
                                       f"gdn_parallel checkpoints are written without any")


def unreadable_tensors(path, names) -> str | None:
    """What is wrong in data files `names` of checkpoint `path`, read as DCP's reader reads them but
    without a model to load into: each item of the index in those files, one at a time, must be a
    tensor that torch's weights_only loader reads. None when every item is."""
    items = sorted((info.relative_path, info.offset, info.length)
                   for info in read_metadata(path).storage_data.values() if info.relative_path in names)
    for name, offset, length in items:
        file = Path(path) / name
        try:
            inside_checkpoint(file, Path(path))
            with open(file, "rb") as handle:
                handle.seek(offset)
                data = handle.read(length)
            if len(data) != length:
                raise EOFError(f"{len(data)} of the {length} bytes at offset {offset}")
            value = load_tensors_file(io.BytesIO(data), map_location="cpu")
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"a {type(value).__name__} at offset {offset}")
        except Exception as err:
            return unsafe_tensor_data(file, err)
    return None


def inside_checkpoint(file: Path, checkpoint: Path) -> None:
    """Refuse a data file that resolves outside its checkpoint directory (a symbolic link out): the
    checksums checked would vouch for another file. loading.verify refuses such a checkpoint before
    its tensors are read; this keeps DCP's reader to the directory too."""
    if resolves_outside(file, checkpoint):
        raise CheckpointUnreadable(f"{file} resolves to {Path(file).resolve()}, outside the checkpoint "
                                   f"directory; a checkpoint's files are read only from inside it")


def unsafe_tensor_data(file, err: BaseException) -> str:
    """The refusal of a data file whose bytes are not a tensor torch's weights_only loader reads."""
    return f"{file} does not hold tensor data that can be read safely ({describe(err)})"


# Errors of the device the tensors are copied to: they say nothing of the file being read.
DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    kind for kind in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError) if kind is not None)


def device_failure(file, err: BaseException) -> str:
    """The refusal of a load whose copy of `file`'s tensors to the device failed."""
    return (f"copying the tensors of {file} to the device failed ({describe(err)}): an error of the device, "
            f"not of the checkpoint's files (CUDA_LAUNCH_BLOCKING=1 names the failing call)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the index read by `read_metadata` above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank indexes (written without collectives) are not read")
        metadata = read_metadata(self.path)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def read_data(self, plan, planner):
        """DCP's read, naming the data file whose bytes are not a tensor (DCP's error names none)."""
        opened = []
        create_stream = self.fs.create_stream

        @contextlib.contextmanager
        def recording(path, mode):
            opened.append(Path(path).name)
            inside_checkpoint(Path(path), Path(self.path))
            with create_stream(path, mode) as stream:
                yield stream

        self.fs.create_stream = recording  # this reader's file system only
        try:
            with quiet_tensor_loader():
                return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except DEVICE_ERRORS as err:   # the copy into the model's tensors, not the file's bytes
            file = opened[-1] if opened else "a data file"
            raise CheckpointDeviceError(device_failure(file, err)) from None
        except Exception as err:
            raise CheckpointUnreadable(unsafe_tensor_data(opened[-1] if opened else "a data file",
                                                          err)) from None
        finally:
            del self.fs.create_stream


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, refusing a non-tensor item instead of unpickling it."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointUnreadable(f"the checkpoint holds a non-tensor entry {read_item.dest_index.fqn!r}; "
                                   f"it is not unpickled")
