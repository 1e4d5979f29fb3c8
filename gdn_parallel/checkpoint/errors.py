"""What goes wrong with checkpoints, as the command line reports it (gdn_parallel/train/__main__.py
maps each to its exit status)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is (damaged, foreign, of another run): refused before
    anything is loaded from it; the message names the file and what to do."""


class CheckpointUnreadable(CheckpointError):
    """One of a checkpoint's files is torn, of the wrong form, or unsafe to read (whatever its
    checksums say): the checkpoint is damaged, and `--resume auto` passes over it."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, no permission): the partial one is removed and
    the earlier ones are intact; the message names the path, the space needed and free."""
