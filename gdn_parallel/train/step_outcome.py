"""Whether a step's update was applied: decided on the device at once, known on the host a step later.

The loop skips a step whose loss or gradient norm is not finite (trainer.py). Deciding that on the
host reads two device values every step: the host waits for the step's last kernel, and the GPU then
waits for the host to launch the next step's first ones. A fused AdamW decides on the device instead:
its kernel takes `found_inf` (as GradScaler hands it over) and leaves parameters, moments and step
counts untouched where it is set. The flag reaches the host through a non-blocking copy and is read
when the device is past it, at the next step (or before an evaluation, a checkpoint, the end): only
then is a skipped step counted and said, and too many in a row stop the run, one step later than a
read at once would. Other optimizers (the non-fused AdamW of CPU runs) are gated on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class ArrivingFlag:
    """A device bool on its way to the host: copied without blocking (CUDA), `value()` waits for that
    copy only, not for work queued after it. A flag already on the host is kept as it is."""

    def __init__(self, flag: torch.Tensor):
        flag = flag.reshape(())
        self._arrived: torch.cuda.Event | None = None
        if flag.is_cuda:
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._arrived = torch.cuda.Event()
            self._arrived.record()
        else:
            self._host = flag.to(torch.bool).clone()

    def value(self) -> bool:
        if self._arrived is not None:
            self._arrived.synchronize()
        return bool(self._host)


@dataclass
class StepOutcome:
    """One optimizer step as the host will book it: its loss and gradient norm (device tensors, read
    when printed) and whether the update was applied (`applied()`, once the flag has arrived);
    `flops`: the step's training FLOPs over every replica (mfu), None where the logger counts them."""
    step: int
    loss: torch.Tensor
    lr: float
    grad_norm: torch.Tensor
    applied_flag: ArrivingFlag
    flops: float | None = None

    def applied(self) -> bool:
        return self.applied_flag.value()


def step_unless_non_finite(optimizer: torch.optim.Optimizer, step: int, loss: torch.Tensor, lr: float,
                           grad_norm: torch.Tensor) -> StepOutcome:
    """optimizer.step() unless the loss or the gradient norm is not finite; without a host read where
    the optimizer is fused."""
    finite = (torch.isfinite(loss) & torch.isfinite(grad_norm)).reshape(())
    if _takes_found_inf(optimizer):
        optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        return StepOutcome(step, loss, lr, grad_norm, ArrivingFlag(finite))
    applied = bool(finite)  # a host read: cheap off the GPU, where the non-fused optimizer runs
    if applied:
        optimizer.step()
    return StepOutcome(step, loss, lr, grad_norm, ArrivingFlag(torch.tensor(applied)))


def applied_outcome(step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> StepOutcome:
    """A step booked as applied (GradScaler skips non-finite float16 steps itself)."""
    return StepOutcome(step, loss, lr, grad_norm, ArrivingFlag(torch.tensor(True)))


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Fused implementations (torch's `_step_supports_amp_scaling`) apply found_inf in their kernel."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
