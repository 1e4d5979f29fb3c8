"""What the steps of one training run share (trainer.py runs them; run_setup.py builds it)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import CheckpointSaver
from ..config import Config
from ..data import TokenBatches
from ..model.flops import TrainingFlops
from ..parallel.mesh import ParallelDims
from ..parallel.parallelize import ParallelModel
from .compile_watch import CompileWatch
from .profiling import StepProfiler
from .progress import ProgressLogger
from .step_outcome import StepOutcome


@dataclass(frozen=True)
class ModelSize:
    """The whole model's size and work (every pipeline stage's, not only this rank's): `flops_per_token`
    of a row that is one document, `flops` of any packed rows (model/flops.py; None: not counted)."""
    num_parameters: int
    flops_per_token: float
    flops: TrainingFlops | None = None


@dataclass(frozen=True)
class Validation:
    """This replica's share of the fixed validation set, on the training device; `text_bytes`: the bytes
    of text its labelled targets stand for (val_bpb), None when the data does not record them."""
    steps: list[list] = field(default_factory=list)
    text_bytes: int | None = None


@dataclass
class RunState:
    """One training run: its parts, built once (run_setup.py), and the counters its steps move on."""
    config: Config
    device: torch.device
    say: Callable[[str], None]          # rank 0 prints, the others do not; above the bar once it exists
    dims: ParallelDims
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], float]    # the learning rate of a step
    scaler: torch.amp.GradScaler | None   # float16 on CUDA only
    autocast_dtype: torch.dtype | None
    batches: TokenBatches
    size: ModelSize
    validation: Validation = field(default_factory=Validation)
    # Made last: the logger's clock starts when it is made, after the checkpoint is loaded.
    logger: ProgressLogger | None = None
    saver: CheckpointSaver | None = None    # None: no checkpoints (disabled, or no train.out_dir)
    profiler: StepProfiler | None = None    # train.profile_steps (a no-op without them)
    start_step: int = 0                 # a resumed run's checkpoint step
    resumed_from: Path | None = None    # the checkpoint a resumed run loaded
    checkpoint_entries: dict = field(default_factory=dict)   # the run's id, for every trainer_state.json
    last_step: int = -1                 # the step run last (start_step - 1 before the first)
    skipped_in_row: int = 0             # non-finite steps in a row, skipped
    pending: StepOutcome | None = None  # the last step, until the host books it (trainer._settle)
    val_loss: float | None = None       # of the last evaluation
    compile_watch: CompileWatch = field(default_factory=CompileWatch)   # what each progress line compiled
    beside_save: bool = False           # a step since the last line ran beside a background save
    alloc_retries_seen: int = 0         # the CUDA allocator's retries counted at the last line

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over every data-parallel replica."""
        train = self.config.train
        return train.batch_size * train.seq_len * self.config.parallel.dp
