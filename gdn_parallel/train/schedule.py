"""Learning-rate schedules (train.lr_schedule), and the rule that a resume keeps the checkpoint's.

Every schedule starts with the same linear warmup, lr * (step + 1) / warmup_steps for updates
0 .. warmup_steps - 1 (update 0 already moves), then, with min_lr = min_lr_ratio * lr:

    cosine    min_lr + (lr - min_lr) (1 + cos(pi p)) / 2,   p = (step - warmup) / (steps - warmup - 1)
    wsd       lr until the last D = round(decay_fraction * steps) updates, then
              min_lr + (lr - min_lr) shape(p),   p = (step - (steps - D) + 1) / D,
              shape(p) = 1 - sqrt(p) (decay_shape 1-sqrt) or 1 - p (linear)
    constant  lr

p is clamped to [0, 1]: cosine and wsd reach min_lr at the last update, steps - 1, and stay there. A
cosine with a single update after the warmup (steps == warmup + 1, steps == 1 without warmup) takes
min_lr there, its last; a warmup as long as the run is refused (config.TrainConfig.validate).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from ..config import ConfigError, TrainConfig


def _cosine(step: int, train: TrainConfig) -> float:
    min_lr = train.lr * train.min_lr_ratio
    decay_steps = train.steps - train.warmup_steps - 1
    if decay_steps <= 0:  # the one update after the warmup is the run's last: min_lr, as every run ends
        progress = 1.0
    else:
        progress = min(max((step - train.warmup_steps) / decay_steps, 0.0), 1.0)
    return min_lr + 0.5 * (train.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


DECAY_SCALES = {"1-sqrt": lambda progress: 1.0 - math.sqrt(progress),
                "linear": lambda progress: 1.0 - progress}


def _warmup_stable_decay(step: int, train: TrainConfig) -> float:
    decay_start = train.steps - train.decay_steps
    if step < decay_start:
        return train.lr
    min_lr = train.lr * train.min_lr_ratio
    progress = min((step - decay_start + 1) / train.decay_steps, 1.0)
    return min_lr + (train.lr - min_lr) * DECAY_SCALES[train.decay_shape](progress)


AFTER_WARMUP = {"cosine": _cosine, "wsd": _warmup_stable_decay, "constant": lambda step, train: train.lr}

# The TrainConfig fields each schedule reads; a resume compares these and lr_schedule.
READS = {"cosine": ("lr", "min_lr_ratio", "warmup_steps", "steps"),
         "wsd": ("lr", "min_lr_ratio", "warmup_steps", "steps", "decay_fraction", "decay_shape"),
         "constant": ("lr", "warmup_steps")}
# A checkpoint written before train.lr_schedule existed ran the cosine schedule.
BEFORE_LR_SCHEDULE = {"lr_schedule": "cosine"}


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate of optimizer update `step` (0-based) under the schedule of `train`."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    return AFTER_WARMUP[train.lr_schedule](step, train)


def schedule_from_config(train: TrainConfig) -> Callable[[int], float]:
    """A function step -> learning rate for a TrainConfig."""
    return lambda step: lr_at(step, train)


def check_resumed_schedule(saved_config: dict, train: TrainConfig, step: int,
                           say: Callable[[str], None]) -> None:
    """A resume at `step` must keep the schedule of the checkpoint's config (`saved_config`, as saved in
    trainer_state.json): the settings either schedule reads, and lr_schedule, are compared, and a
    difference is refused (as Megatron refuses a scheduler mismatch) naming each field and the override.
    With train.schedule_override the new schedule holds from `step` on, evaluated there (no re-basing);
    one line says the LR at `step` under the saved schedule and under the new one.

    A step-0 checkpoint (gdn-convert from-hf) has applied no learning rate: there is nothing to keep."""
    if step == 0:
        return
    saved = {**BEFORE_LR_SCHEDULE, **saved_config.get("train", {})}
    compared = ["lr_schedule", *dict.fromkeys(READS.get(saved["lr_schedule"], ()) + READS[train.lr_schedule])]
    differing = [name for name in compared if saved.get(name) != getattr(train, name)]
    if not differing:
        return
    changes = ", ".join(f"train.{name}: saved {repr(saved[name]) if name in saved else '(not recorded)'}, "
                        f"new {getattr(train, name)!r}" for name in differing)
    old_lr, new_lr = _saved_lr_at(step, saved), lr_at(step, train)
    at_step = f"LR at step {step}: {_format_lr(old_lr)} saved, {_format_lr(new_lr)} new"
    if not train.schedule_override:
        raise ConfigError(f"the checkpoint was trained under another LR schedule ({changes}); resume with "
                          f"its settings (the checkpoint's config.yaml), or give "
                          f"--set train.schedule_override=true to follow the new schedule from step {step} "
                          f"({at_step})")
    say(f"resume | train.schedule_override: the new LR schedule from step {step} ({changes}); {at_step}")


def _saved_lr_at(step: int, saved: dict) -> float | None:
    """The saved schedule's LR at `step`; None when the checkpoint does not record what it reads."""
    reads = READS.get(saved["lr_schedule"])
    if reads is None or any(name not in saved for name in reads):
        return None
    return lr_at(step, replace(TrainConfig(), lr_schedule=saved["lr_schedule"],
                               **{name: saved[name] for name in reads}))


def _format_lr(lr: float | None) -> str:
    return "unknown" if lr is None else f"{lr:.3e}"
