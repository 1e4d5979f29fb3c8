"""Saving and resuming a run: model, optimizer, step (and with it the LR schedule position), data
positions, random generator states, the resolved config and the layout it was saved under.

Every rank calls `save` and `load` (they are collectives). Tensors go through
torch.distributed.checkpoint in layout-free form (state.py), so a run resumes under any layout;
the small rest is JSON written by rank 0, plus one RNG file per rank.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..config import Config, ConfigError
from . import files
from .state import apply_loaded, state_to_save, targets_to_load

FORMAT_VERSION = 1
LAYOUT_DEGREES = ("tp", "pp", "cp", "dp")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _flag_device() -> torch.device:
    """Where a small collective buffer lives: NCCL reduces CUDA tensors only."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def layout_record(config: Config, world: int) -> dict:
    """trainer_state.json's `layout`: the parallel degrees of the `world` processes that wrote the
    checkpoint (all 1 for one process, whatever degrees its config names)."""
    pc = config.parallel
    degrees = {name: getattr(pc, name) if world > 1 else 1 for name in LAYOUT_DEGREES}
    return {"world_size": world, **degrees, "data_parallel": pc.data_parallel, "cp_algorithm": pc.cp_algorithm}


def checkpoint_record(step: int, config: Config, world: int, data_stream: Dict[str, Any],
                      **extra: Any) -> Dict[str, Any]:
    """What trainer_state.json holds: the step (completed optimizer steps, hence the LR schedule's
    position), the resolved config, the layout, the data stream's position, and any `extra` entries."""
    return {"format_version": FORMAT_VERSION, "step": step, "config": config.to_dict(),
            "layout": layout_record(config, world), "data": {"stream": data_stream}, **extra}


def seal(directory: Path, record: Dict[str, Any], config: Config) -> None:
    """Complete a checkpoint directory whose tensors are written: trainer_state.json, the config to
    resume with (config.yaml), and COMPLETE last. The one writer of these files, for the trainer's
    saves and the converters' checkpoints alike."""
    directory = Path(directory)
    (directory / files.TRAINER_STATE).write_text(json.dumps(record, indent=1))
    (directory / files.CONFIG_COPY).write_text(config.to_yaml(), encoding="utf-8")
    (directory / files.COMPLETE).write_text("")


class CheckpointSaver:
    """Saves checkpoints of one run, synchronously or (async_save) in the background: an asynchronous
    save is published (renamed complete) once it has finished, at the latest by the next save or by
    `finish()`. Old complete checkpoints beyond `keep` are deleted as new ones are published."""

    def __init__(self, out_dir: str, keep: int = 0, async_save: bool = False):
        self.out_dir, self.keep, self.async_save = out_dir, keep, async_save
        self._pending: Optional[Tuple[Any, int, dict, Config]] = None   # an async save: future, step, record, config
        self.published: List[Path] = []
        # An asynchronous save coordinates the ranks (plan gather, metadata, barrier) from a background
        # thread while training goes on. On the training collectives' group the two threads' calls
        # interleave differently on each rank: tp = 2 deadlocked, dp = 2 aborted with a gloo
        # "collective mismatch". So it gets a group of its own, on gloo (it exchanges Python objects
        # of staged CPU copies; also when training runs on NCCL). Every rank builds the saver, so
        # every rank takes part in creating the group.
        self._save_group = (dist.new_group(backend="gloo")
                            if async_save and dist.is_initialized() and dist.get_world_size() > 1 else None)

    def save(self, step: int, named_params: List[Tuple[str, nn.Parameter]], optimizer, dims, config: Config,
             data_stream: Dict[str, Any], **extra: Any) -> None:
        """Write checkpoint `step` (completed optimizer steps) of the run `config` describes.
        data_stream: the stream's position (the same on every rank); extra: more trainer_state.json entries."""
        self.finish()  # one save in flight at a time
        partial = files.partial_path(self.out_dir, step)
        if _rank() == 0:
            if partial.exists():  # an earlier, interrupted save of this step: none of its files may stay
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        _barrier()
        torch.save(rng_state(), partial / f"rng_rank{_rank()}.pt")
        state = state_to_save(named_params, optimizer, dims)
        world = dist.get_world_size() if dist.is_initialized() else 1
        record = checkpoint_record(step, config, world, data_stream, **extra)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._save_group)
            self._pending = (future, step, record, config)
            return
        dcp.save(state, checkpoint_id=str(partial))
        self._publish(step, record, config)

    def poll(self) -> None:
        """Publish a finished asynchronous save (cheap; call once per step). Every rank must call it at
        the same steps: publishing is a collective."""
        if self._pending is not None:
            done = torch.tensor([float(self._pending[0].done())], device=_flag_device())
            if dist.is_initialized():
                dist.all_reduce(done, op=dist.ReduceOp.MIN)  # every rank's part written
            if done.item():
                self.finish()

    def finish(self) -> None:
        if self._pending is None:
            return
        future, step, record, config = self._pending
        future.result()
        self._pending = None
        self._publish(step, record, config)

    def _publish(self, step: int, record: Dict[str, Any], config: Config) -> None:
        _barrier()  # every rank's tensors and RNG file are on disk
        if _rank() == 0:
            seal(files.partial_path(self.out_dir, step), record, config)
            self.published.append(files.publish(self.out_dir, step))
            files.prune(self.out_dir, self.keep)
        _barrier()


def resolve_resume(resume: Optional[str], out_dir: str) -> Optional[Path]:
    """`--resume auto`: the newest complete checkpoint under out_dir (None when there is none yet);
    `--resume PATH`: that checkpoint, which must be complete."""
    if not resume:
        return None
    if resume == "auto":
        if not out_dir:
            raise ConfigError("--resume auto looks for checkpoints under train.out_dir, which is empty; set "
                              "train.out_dir (or give --resume PATH)")
        return files.latest_checkpoint(out_dir)
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"--resume {resume}: no such checkpoint directory")
    if not files.is_complete(path):
        raise ConfigError(f"--resume {resume}: not a complete checkpoint (no {files.COMPLETE} marker or "
                          f"{files.TRAINER_STATE}: an interrupted save?); use --resume auto or another step")
    return path


def read_trainer_state(path: Path) -> Dict[str, Any]:
    return json.loads((Path(path) / files.TRAINER_STATE).read_text())


def check_compatible(saved: Dict[str, Any], config: Config) -> None:
    """The model a checkpoint holds must be the configured one: name every differing model field."""
    saved_model = saved.get("config", {}).get("model", {})
    current = config.to_dict()["model"]
    # Fields that do not change the parameters may differ (an implementation, a fused loss).
    free = {"gdn_impl", "attn_impl", "fused_linear_cross_entropy", "initializer_range"}
    differing = sorted(k for k in current if k not in free and saved_model.get(k) != current[k])
    if differing:
        details = ", ".join(f"model.{k}: checkpoint {saved_model.get(k)!r}, config {current[k]!r}" for k in differing)
        raise ConfigError(f"the checkpoint holds another model ({details}); resume with the config it was "
                          f"saved with (its config.yaml) or start a new train.out_dir")


def load(path: Path, named_params: List[Tuple[str, nn.Parameter]], optimizer, dims, config: Config,
         same_layout: Callable[[Dict[str, Any]], bool]) -> Dict[str, Any]:
    """Load checkpoint `path` into this rank's parameters and optimizer; returns its trainer state.
    The RNG states are restored when the layout is the same (same ranks)."""
    saved = read_trainer_state(path)
    check_compatible(saved, config)
    targets = targets_to_load(named_params, optimizer, dims)
    dcp.load(targets, checkpoint_id=str(path))
    apply_loaded(named_params, optimizer, targets)
    rng_file = Path(path) / f"rng_rank{_rank()}.pt"
    if same_layout(saved) and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return saved
