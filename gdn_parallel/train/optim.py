"""AdamW with weight decay on matrices only, and the autocast dtype of a run."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..model import NO_WEIGHT_DECAY


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: 1-D parameters and those marked `_no_weight_decay` get none.
    `params`: a module's parameters, or the parameters a rank trains (e.g. a pipeline rank's)."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    decay, no_decay, seen = [], [], set()
    for param in params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if param.dim() < 2 or getattr(param, NO_WEIGHT_DECAY, False):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(params, train_config, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(params, train_config.weight_decay), lr=train_config.lr,
                             betas=(train_config.beta1, train_config.beta2), fused=device.type == "cuda")


def autocast_dtype(dtype_name: str, device: torch.device) -> torch.dtype | None:
    """bf16/fp16 autocast on CUDA; float32, and any CPU run, train without autocast."""
    if device.type != "cuda" or dtype_name == "float32":
        return None
    return getattr(torch, dtype_name)
