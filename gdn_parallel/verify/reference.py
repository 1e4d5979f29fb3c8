"""The single-device reference every rank holds on its own: the whole model from the same seed as
every layout, the whole batch of every step, the same optimizer.

`gradients(batch)`: each micro-batch's summed token loss over the step's label count, backward
micro-batch by micro-batch (the gradients add up to those of the mean loss, with one micro-batch's
activations at a time); the loss, the global gradient norm and every gradient. `step(grads)`: AdamW
on the given gradients. The reference steps with a layout's own gradients and then takes the
layout's parameters (runner.py), so that every step compares the two at the same point.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import IGNORE_INDEX, ModelConfig
from ..data.packing import PackedBatch
from ..model import NO_WEIGHT_DECAY, build_model


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW at a constant learning rate (the schedule's peak: a warm-up's first tiny steps would
    hardly move the parameters whose comparison checks the update) and the clipping norm."""
    lr: float
    betas: tuple
    weight_decay: float
    grad_clip: float          # inf: no clipping (the norm is still compared)

    @classmethod
    def from_train_config(cls, train) -> OptimizerSettings:
        clip = train.grad_clip if train.grad_clip > 0 else float("inf")
        return cls(train.lr, (train.beta1, train.beta2), train.weight_decay, clip)

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices only, as the trainer builds it (train/optim.py)."""
        decay, no_decay = [], []
        for p in params:
            if p.requires_grad:
                (no_decay if p.dim() < 2 or getattr(p, NO_WEIGHT_DECAY, False) else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=self.betas)


@dataclass
class StepGradients:
    loss: float
    grad_norm: float
    grads: dict[str, torch.Tensor]


def autocast(dtype: torch.dtype | None, device: torch.device):
    """The autocast of ParallelModel.train_step (no weight-cast cache), or nothing for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def label_count(batch: Sequence[PackedBatch]) -> int:
    count = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batch)
    if count == 0:
        raise ValueError("the verification batch has no label tokens: raise --seq-len or --rows")
    return count


class ReferenceModel:
    """The whole model on this rank's device with its AdamW; `reset()` returns to the seed's weights."""

    def __init__(self, model_config: ModelConfig, seed: int, device: torch.device,
                 optimizer: OptimizerSettings):
        self.model = build_model(model_config, device, seed)
        self.model.train()
        self.device = device
        self.settings = optimizer
        self.params: dict[str, nn.Parameter] = {n: p for n, p in self.model.named_parameters()
                                                if p.requires_grad}
        self._initial = {n: p.detach().clone() for n, p in self.params.items()}
        self.optimizer = optimizer.build(self.params.values())

    @property
    def names(self):
        return list(self.params)

    def reset(self) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self._initial[name])
                p.grad = None
        self.optimizer = self.settings.build(self.params.values())

    def gradients(self, batch: Sequence[PackedBatch],
                  autocast_dtype: torch.dtype | None = None) -> StepGradients:
        labels = label_count(batch)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in batch:
            with autocast(autocast_dtype, self.device):
                out = self.model(mb.input_ids, labels=mb.labels, cu_seqlens=mb.cu_seqlens,
                                 position_ids=mb.position_ids)
                part = out.loss_sum / labels
            part.backward()
            loss += part.detach().double()
        grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in self.params.items()}
        for p in self.params.values():
            p.grad = None
        norm = torch.stack([g.double().pow(2).sum() for g in grads.values()]).sum().sqrt()
        return StepGradients(float(loss), float(norm), grads)

    @torch.no_grad()
    def evaluate(self, batch: Sequence[PackedBatch]) -> tuple[float, int]:
        """(summed token loss, label count) of the rows in fp32, forward only in eval mode: the
        quantity ParallelModel.evaluate returns."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            for mb in batch:
                out = self.model(mb.input_ids, labels=mb.labels, cu_seqlens=mb.cu_seqlens,
                                 position_ids=mb.position_ids)
                total += out.loss_sum.double()
        finally:
            self.model.train()
        return float(total), label_count(batch)

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        """AdamW on `grads` (parameters without one keep their values and state)."""
        for name, p in self.params.items():
            p.grad = grads[name].to(p.dtype) if name in grads else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def load(self, name: str, value: torch.Tensor) -> None:
        self.params[name].copy_(value)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor parallel.data_parallel.clip_grad_norm (like torch's) scales gradients by."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
