"""Saving a run: model, optimizer, step (and with it the LR schedule position), data position,
random generator states, the resolved config and the layout it was saved under (loading.py reads
them back).

Every rank calls `save` (a collective). Tensors go through torch.distributed.checkpoint in
layout-free form (state.py), so a run resumes under any layout; the small rest is JSON and YAML
written by rank 0, one RNG file per rank, and the checksums of every file (integrity.py), hashed by
the ranks in shares. A save that fails on any rank (a full disk) fails on every rank with one
CheckpointWriteError naming the path, the space needed and free; its partial directory is removed
and the earlier checkpoints stay as they were.
"""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from ..config import Config
from ..parallel.mesh import MESH_DIMS
from . import files, integrity, ranks
from .errors import CheckpointWriteError
from .staging import AlreadyStaged, HostStaging
from .state import state_to_save

FORMAT_VERSION = 1
LAYOUT_DEGREES = MESH_DIMS   # a layout record names the degrees of the mesh's dimensions


def rng_state() -> dict:
    """This process's random generator states, as tensors and plain data (read with weights_only)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def layout_record(config: Config, world: int) -> dict:
    """trainer_state.json's `layout`: the parallel degrees of the `world` processes that wrote the
    checkpoint (all 1 for one process, whatever degrees its config names)."""
    pc = config.parallel
    degrees = {name: getattr(pc, name) if world > 1 else 1 for name in LAYOUT_DEGREES}
    return {"world_size": world, **degrees, "data_parallel": pc.data_parallel,
            "cp_algorithm": pc.cp_algorithm}


def checkpoint_record(step: int, config: Config, world: int, data_stream: dict[str, Any],
                      **extra: Any) -> dict[str, Any]:
    """What trainer_state.json holds: the step (completed optimizer steps, hence the LR schedule's
    position), the resolved config, the layout, the data stream's position, and any `extra` entries."""
    return {"format_version": FORMAT_VERSION, "step": step, "config": config.to_dict(),
            "layout": layout_record(config, world), "data": {"stream": data_stream}, **extra}


def seal(directory: Path, record: dict[str, Any], config: Config,
         checksums: dict[str, dict] | None = None, attachments: dict[str, bytes] | None = None) -> None:
    """Complete a checkpoint directory whose tensors are written: trainer_state.json, the config to
    resume with (config.yaml), `attachments` (file name -> bytes: the tokenizer of the run's data,
    gdn_parallel/data/tokenizer_record.py), the checksums of every file (`checksums`: those of the files
    already there, hashed by the ranks; None: hashed here), and COMPLETE last. The one writer of these
    files, for the trainer's saves and the converters' checkpoints alike."""
    directory = Path(directory)
    if checksums is None:
        checksums = integrity.checksums(directory, _files_to_hash(directory))
    attachments = attachments or {}
    (directory / files.TRAINER_STATE).write_text(json.dumps(record, indent=1))
    (directory / files.CONFIG_COPY).write_text(config.to_yaml(), encoding="utf-8")
    for name, data in attachments.items():
        (directory / name).write_bytes(data)
    integrity.write_manifest(directory, {**checksums, **integrity.checksums(
        directory, [files.TRAINER_STATE, files.CONFIG_COPY, *attachments])})
    (directory / files.COMPLETE).write_text("")


def _files_to_hash(directory: Path) -> list[str]:
    """The files of a checkpoint being written whose checksums are recorded (all but what seal writes)."""
    own = {files.TRAINER_STATE, files.CONFIG_COPY, files.COMPLETE, integrity.MANIFEST}
    return sorted(p.name for p in Path(directory).iterdir() if p.is_file() and p.name not in own)


def _shared_checksums(directory: Path) -> dict[str, dict]:
    """The checksums of a checkpoint's files, each rank hashing a share (a collective)."""
    names: Sequence[str] = ranks.gathered(_files_to_hash(directory) if ranks.rank() == 0 else None)[0]
    mine = integrity.checksums(directory, names[ranks.rank()::ranks.world()])
    merged: dict[str, dict] = {}
    for part in ranks.gathered(mine):
        merged.update(part)
    return merged


class CheckpointSaver:
    """Saves checkpoints of one run, synchronously or (async_save) in the background: an asynchronous
    save is published (renamed complete) once it has finished, at the latest by the next save or by
    `finish()`. Old complete checkpoints beyond `keep` are deleted as new ones are published."""

    def __init__(self, out_dir: str, keep: int = 0, async_save: bool = False,
                 timeout: timedelta | None = None, attachments: dict[str, bytes] | None = None):
        self.out_dir, self.keep, self.async_save = out_dir, keep, async_save
        self.attachments = dict(attachments or {})   # files every checkpoint of the run carries (seal)
        # an async save in flight: its future, step, record and config
        self._pending: tuple[Any, int, dict, Config] | None = None
        self.published: list[Path] = []
        # An asynchronous save coordinates the ranks (plan gather, metadata, barrier) from a background
        # thread while training goes on. On the training collectives' group the two threads' calls
        # interleave differently on each rank: tp = 2 deadlocked, dp = 2 aborted with a gloo
        # "collective mismatch". So it gets a group of its own, on gloo (it exchanges Python objects
        # of staged CPU copies; also when training runs on NCCL). Every rank builds the saver, so
        # every rank takes part in creating the group. A new group does not inherit the default
        # group's timeout: it is given the run's. One process needs it too: DCP refuses a background
        # save on a group without a CPU backend (a one-GPU run's default group is NCCL alone).
        background = async_save and dist.is_initialized()
        several = background and dist.get_world_size() > 1
        self._save_group = dist.new_group(backend="gloo", timeout=timeout or None) if background else None
        # The ranks agree that a background save is written (poll, once a step) on a gloo group of its
        # own too: on the training group (NCCL) the flag would be a CUDA tensor read back every step, a
        # wait for the whole queued step while the save is in flight.
        self._poll_group = dist.new_group(backend="gloo", timeout=timeout or None) if several else None
        self._staging = HostStaging()

    def save(self, step: int, named_params: list[tuple[str, nn.Parameter]], optimizer, dims, config: Config,
             data_stream: dict[str, Any], **extra: Any) -> Path:
        """Write checkpoint `step` (completed optimizer steps) of the run `config` describes; returns the
        path it is published at (an asynchronous save: will be, once written). data_stream: the stream's
        position (the same on every rank); extra: more trainer_state.json entries."""
        self.finish()  # one save in flight at a time
        partial = files.partial_path(self.out_dir, step)
        state = state_to_save(named_params, optimizer, dims)   # gathers, where any, are collectives
        record = checkpoint_record(step, config, ranks.world(), data_stream, **extra)

        def start() -> dict:
            if ranks.rank() == 0:
                if partial.exists():  # an earlier, interrupted save of this step: none of its files may stay
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            ranks.barrier()
            torch.save(rng_state(), partial / f"rng_rank{ranks.rank()}.pt")
            return self._staging.stage(state)   # a failure here (host memory) fails every rank's save
        state = self._agree(step, start)
        try:
            if self.async_save:
                future = dcp.async_save(state, storage_writer=_host_writer(partial),
                                        process_group=self._save_group, **_staged_keyword())
                self._pending = (future, step, record, config)
                return files.final_path(self.out_dir, step)
            dcp.save(state, storage_writer=_host_writer(partial))
        except (Exception, CheckpointException) as err:   # DCP raises on every rank alike
            raise self._failed(step, err) from None
        self._publish(step, record, config)
        return files.final_path(self.out_dir, step)

    @property
    def in_flight(self) -> bool:
        """An asynchronous save started and not yet published."""
        return self._pending is not None

    def poll(self) -> None:
        """Publish a finished asynchronous save (cheap; call once per step). Every rank must call it at
        the same steps: publishing is a collective."""
        if self._pending is not None:
            done = torch.tensor([float(self._pending[0].done())])
            if self._poll_group is not None:
                # every rank's part written
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
            if done.item():
                self.finish()

    def finish(self) -> None:
        if self._pending is None:
            return
        future, step, record, config = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as err:
            raise self._failed(step, err) from None
        self._publish(step, record, config)

    def _publish(self, step: int, record: dict[str, Any], config: Config) -> None:
        ranks.barrier()  # every rank's tensors and RNG file are on disk
        partial = files.partial_path(self.out_dir, step)
        checksums = self._agree(step, lambda: _shared_checksums(partial))

        def publish() -> None:
            if ranks.rank() == 0:
                seal(partial, record, config, checksums, self.attachments)
                self.published.append(files.publish(self.out_dir, step))
                files.prune(self.out_dir, self.keep)
        self._agree(step, publish)

    def _agree(self, step: int, part):
        """Run a part of the save on this rank; a failure on any rank fails the save on every rank."""
        def failed(error: str) -> BaseException:
            return self._failed(step, error)
        return ranks.agree(part, failed)

    def _failed(self, step: int, error) -> CheckpointWriteError:
        """The save of `step` failed (on some rank): remove its partial directory and say why, where,
        and how much space it needs and has (every rank returns the same error)."""
        partial = files.partial_path(self.out_dir, step)
        cause = error if isinstance(error, str) else ranks.describe(error)
        ranks.barrier()
        needed = _checkpoint_bytes(self.out_dir)
        if ranks.rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        checkpoints = files.checkpoints_dir(self.out_dir)
        free = shutil.disk_usage(checkpoints if checkpoints.is_dir() else self.out_dir).free
        newest = files.latest_checkpoint(self.out_dir)
        return CheckpointWriteError(
            f"saving checkpoint {files.final_path(self.out_dir, step)} failed: {cause}. "
            + (f"A checkpoint takes about {_gib(needed)} (the last one); " if needed else "")
            + f"{_gib(free)} are free on that file system. The partial checkpoint was removed; "
            + (f"the newest complete one is {newest} (--resume auto continues from it)" if newest is not None
               else "there is no earlier checkpoint"))




def _host_writer(directory: Path) -> dcp.FileSystemWriter:
    """DCP's file writer for tensors that are on the host already (staging.py), making no CUDA call.
    DCP's default (a copy-ahead loader on a CUDA machine) takes the writing thread's current CUDA
    stream and synchronizes it every ~10 MB; in a background save that thread is on device 0 of every
    rank (a new thread's default). With it, the step after a background save took x1.76 the median at
    1M tokens on 4 H100s; without, x1.02 on 4 H200s (docs/multi_gpu/README.md, 2026-11-28)."""
    return dcp.FileSystemWriter(str(directory), per_thread_copy_ahead=0)


def _staged_keyword() -> dict:
    """dcp.async_save's keyword that skips its own staging (the state is on the host already), where
    this torch has it."""
    import inspect
    takes_stager = "async_stager" in inspect.signature(dcp.async_save).parameters
    return {"async_stager": AlreadyStaged()} if takes_stager else {}


def _checkpoint_bytes(out_dir: str) -> int:
    newest = files.latest_checkpoint(out_dir)
    return sum(p.stat().st_size for p in newest.iterdir() if p.is_file()) if newest is not None else 0


def _gib(count: int) -> str:
    return f"{count / 2 ** 30:.2f} GiB"
