"""Training: the single-process loop, its LR schedule and progress reporting.

    python -m gdn_parallel.train --config configs/tiny-cpu.yaml --set train.lr=1e-3 --steps 50
"""
from .loop import run_training
from .schedule import lr_at

__all__ = ["run_training", "lr_at"]
