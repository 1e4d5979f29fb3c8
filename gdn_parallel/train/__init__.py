"""Training: the one loop for every world size (trainer.py: the loop and its steps; run_setup.py:
everything a run needs before its first step, gathered in run_state.RunState), the LR schedule,
validation, the optimizer and progress reporting.

    python -m gdn_parallel.train --config configs/tiny-cpu.yaml --set train.lr=1e-3 --steps 50
"""
from .schedule import lr_at
from .trainer import run_training

__all__ = ["run_training", "lr_at"]
