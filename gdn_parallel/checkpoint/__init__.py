"""Checkpoints of a run under any layout, resumable under any other (torch.distributed.checkpoint):
files.py (where they live, which are complete), state.py (the layout-free tensor form), manager.py
(saving, asynchronous publishing, the one writer of the format), loading.py (verifying, finding and
loading), reading.py (the index read without running code), integrity.py (checksums), ranks.py
(failures agreed by every rank), errors.py."""
from .errors import CheckpointError, CheckpointWriteError
from .files import complete_checkpoints, latest_checkpoint
from .loading import load as load_checkpoint
from .loading import read_trainer_state, resolve_resume
from .manager import CheckpointSaver

__all__ = ["CheckpointError", "CheckpointSaver", "CheckpointWriteError", "complete_checkpoints",
           "latest_checkpoint", "load_checkpoint", "read_trainer_state", "resolve_resume"]
