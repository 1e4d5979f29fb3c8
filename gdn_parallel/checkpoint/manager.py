"""Saving and resuming a run: model, optimizer, step (and with it the LR schedule position), data
positions, random generator states, the resolved config and the layout it was saved under.

Every rank calls `save` and `load` (they are collectives). Tensors go through
torch.distributed.checkpoint in layout-free form (state.py), so a run resumes under any layout;
the small rest is JSON written by rank 0, plus one RNG file per rank.
"""
from __future__ import annotations

import json
import random
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


class CheckpointSaver:
    """Saves checkpoints of one run, synchronously or (async_save) in the background: an asynchronous
    save is published (renamed complete) once it has finished, at the latest by the next save or by
    `finish()`. Old complete checkpoints beyond `keep` are deleted as new ones are published."""

    def __init__(self, out_dir: str, keep: int = 0, async_save: bool = False):
        self.out_dir, self.keep, self.async_save = out_dir, keep, async_save
        self._pending: Optional[Tuple[Any, int, dict]] = None   # (future, step, state) of an async save
        self.published: List[Path] = []

    def save(self, step: int, named_params: List[Tuple[str, nn.Parameter]], optimizer, dims,
             trainer_state: Dict[str, Any]) -> None:
        """Write checkpoint `step` (completed optimizer steps). trainer_state: JSON-able, from every rank
        (rank 0's is written; data positions should already be gathered into it)."""
        self.finish()  # one save in flight at a time
        partial = files.partial_path(self.out_dir, step)
        if _rank() == 0:
            partial.mkdir(parents=True, exist_ok=True)
        _barrier()
        torch.save(rng_state(), partial / f"rng_rank{_rank()}.pt")
        state = state_to_save(named_params, optimizer, dims)
        if self.async_save:
            self._pending = (dcp.async_save(state, checkpoint_id=str(partial)), step, trainer_state)
            return
        dcp.save(state, checkpoint_id=str(partial))
        self._publish(step, trainer_state)

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
        future, step, trainer_state = self._pending
        future.result()
        self._pending = None
        self._publish(step, trainer_state)

    def _publish(self, step: int, trainer_state: Dict[str, Any]) -> None:
        _barrier()  # every rank's tensors and RNG file are on disk
        if _rank() == 0:
            partial = files.partial_path(self.out_dir, step)
            state = {"format_version": FORMAT_VERSION, "step": step, **trainer_state}
            (partial / files.TRAINER_STATE).write_text(json.dumps(state, indent=1))
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
