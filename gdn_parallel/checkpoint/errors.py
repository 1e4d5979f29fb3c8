"""What goes wrong with checkpoints, as the command line reports it (gdn_parallel/train/__main__.py
maps each to its exit status)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is (damaged, foreign, of another run): refused before
    anything is loaded from it; the message names the file and what to do."""


class CheckpointUnreadable(CheckpointError):
    """One of a checkpoint's files is torn, of the wrong form, or unsafe to read (whatever its
    checksums say): the checkpoint is damaged, and `--resume auto` passes over it."""


class CheckpointOfAnotherRun(CheckpointError):
    """A checkpoint whose run id is not the run id of the train.out_dir it is resumed into (copied or
    linked in from another run's out_dir): refused unless checkpoint.allow_other_run=true."""


class CheckpointDeviceError(CheckpointError):
    """Loading a checkpoint's tensors failed on the device (a CUDA error, out of memory), not in its
    files: the checkpoint is not passed over as damaged; the run stops, naming the device's error."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, no permission): the partial one is removed and
    the earlier ones are intact; the message names the path, the space needed and free."""
