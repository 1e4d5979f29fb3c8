"""Checkpoints of a run under any layout, resumable under any other (torch.distributed.checkpoint):
files.py (where they live, which are complete), state.py (the layout-free tensor form), manager.py
(saving, asynchronous publishing, loading, compatibility)."""
from .files import complete_checkpoints, latest_checkpoint
from .manager import CheckpointSaver, read_trainer_state, resolve_resume
from .manager import load as load_checkpoint

__all__ = ["CheckpointSaver", "complete_checkpoints", "latest_checkpoint", "load_checkpoint", "read_trainer_state",
           "resolve_resume"]
