"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`."""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of optimizer update `step` (0-based) of `total_steps`.

    Warmup: lr * (step + 1) / warmup_steps for the first warmup_steps updates (so update 0 already
    moves), reaching lr at update warmup_steps - 1. Then a half cosine from lr down to
    min_lr_ratio * lr, reached at the last update.
    """
    min_lr = lr * min_lr_ratio
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps - 1
    if decay_steps <= 0:
        return lr
    progress = min(max((step - warmup_steps) / decay_steps, 0.0), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_from_config(train_config):
    """A function step -> learning rate for a TrainConfig."""
    def schedule(step: int) -> float:
        return lr_at(step, train_config.lr, train_config.warmup_steps, train_config.steps,
                     train_config.min_lr_ratio)
    return schedule
