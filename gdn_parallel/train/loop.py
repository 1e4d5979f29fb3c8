"""The single-process training loop: data -> HybridLM -> AdamW, with warmup + cosine, clipping, eval.

`run_training(config)` trains `config.train.steps` optimizer updates and returns a summary dict:
first_loss (step 0), final_loss (mean over the last logged interval), val_loss (None when there is
no validation data), steps, tokens_per_s (training throughput after step 0), and a few extras.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from pathlib import Path
from typing import Iterable, List, Optional

import torch

from ..config import Config, ConfigError
from ..data.corpus import load_corpus
from ..data.packing import PackedBatch, packed_batches
from ..ops.triton_dispatch import check_kernel_config
from .progress import ProgressLogger, format_duration, peak_flops_per_s
from .schedule import schedule_from_config


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"train.device={name!r} is not a device: {err}; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA device is available; use auto or cpu")
    return device


def param_groups(model, weight_decay: float) -> List[dict]:
    """Weight decay on matrices only: 1-D parameters and those marked `_no_weight_decay` get none.
    `model`: a module, or the parameters to train (e.g. a pipeline rank's)."""
    decay, no_decay, seen = [], [], set()
    for param in (model.parameters() if isinstance(model, torch.nn.Module) else model):
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if param.dim() < 2 or getattr(param, "_no_weight_decay", False):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, train_config, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, train_config.weight_decay), lr=train_config.lr,
                             betas=(train_config.beta1, train_config.beta2),
                             fused=device.type == "cuda")


def autocast_context(dtype_name: str, device: torch.device):
    """bf16/fp16 autocast on CUDA; float32 (and any CPU run) trains without autocast."""
    if device.type != "cuda" or dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=getattr(torch, dtype_name))


def forward(model, batch: PackedBatch):
    return model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens,
                 position_ids=batch.position_ids)


def accumulate_gradients(model, microbatches: List[PackedBatch], dtype_name: str, device: torch.device,
                         scaler=None) -> torch.Tensor:
    """Forward and backward of each micro-batch, its summed loss divided by the label tokens of the
    whole optimizer batch: the gradients add up to those of the batch's mean loss. Returns that mean."""
    count = max(sum(mb.num_label_tokens for mb in microbatches), 1)
    total = None
    for mb in microbatches:
        with autocast_context(dtype_name, device):
            loss = forward(model, mb).loss_sum / count
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


@torch.no_grad()
def evaluate(model, batches: Iterable[PackedBatch], device: torch.device, dtype_name: str) -> Optional[float]:
    """Token-weighted mean loss over the given batches (None when there are none)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches:
            with autocast_context(dtype_name, device):
                out = forward(model, batch.to(device))
            total += float(out.loss) * out.num_tokens
            count += out.num_tokens
    finally:
        model.train(was_training)
    return total / count if count else None


def run_training(config: Config, print_fn=None) -> dict:
    config.validate()
    train = config.train
    say = print_fn or (lambda line: print(line, flush=True))
    torch.manual_seed(train.seed)
    if train.threads > 0:
        torch.set_num_threads(train.threads)
    device = resolve_device(train.device)
    check_kernel_config(config.model, device.type == "cuda", train.dtype)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    if device.type != "cuda" and train.dtype != "float32":
        say(f"note: train.dtype={train.dtype} applies to CUDA autocast; training in float32 on {device}")

    from ..model import HybridLM  # the model package is imported only when training starts
    from ..parallel.checkpointing import apply_activation_checkpointing

    corpus = load_corpus(config.data)
    model = HybridLM(config.model).to(device)
    apply_activation_checkpointing(model, train.activation_checkpointing)
    model.train()
    optimizer = build_optimizer(model, train, device)
    schedule = schedule_from_config(train)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and train.dtype == "float16" else None
    params = [p for g in optimizer.param_groups for p in g["params"]]

    tokens_per_step = train.batch_size * train.seq_len
    say(f"data  | {corpus.describe()}")
    say(f"model | {model.num_parameters():,} parameters | layers {config.model.layer_types} | "
        f"hidden {config.model.hidden_size}")
    say(f"train | device {device} | dtype {train.dtype} | threads {torch.get_num_threads()} | "
        f"{train.steps} steps x {train.batch_size} x {train.seq_len} tokens | lr {train.lr:g} "
        f"warmup {train.warmup_steps}")
    if train.out_dir:
        Path(train.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(train.out_dir) / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")

    # A step is batch_size sequences in micro-batches of microbatch_size (gradient accumulation); the
    # rows come in the same order whatever the split, since every row boundary is a document boundary.
    micro = train.microbatch_rows
    batches = packed_batches(corpus.train, train.seq_len, micro, seed=config.data.seed)
    eval_set: List[PackedBatch] = []
    if corpus.val:
        eval_set = list(itertools.islice(
            packed_batches(corpus.val, train.seq_len, micro, seed=config.data.seed,
                           epochs=1, drop_last=False), train.eval_batches * train.microbatches))

    flops_per_token = float(model.flops_per_token(train.seq_len))
    logger = ProgressLogger(train.steps, train.log_every, tokens_per_step, device,
                            flops_per_token=flops_per_token, peak_flops=peak_flops_per_s(train, device),
                            out_dir=train.out_dir, print_fn=say)
    val_loss = None
    clip = train.grad_clip if train.grad_clip > 0 else math.inf
    try:
        for step in range(train.steps):
            microbatches = [next(batches).to(device, non_blocking=True) for _ in range(train.microbatches)]
            lr = schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = accumulate_gradients(model, microbatches, train.dtype, device, scaler)
            if scaler is not None:
                scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            logger.step(step, loss, lr, grad_norm)

            last = step == train.steps - 1
            if eval_set and (last or (train.eval_every > 0 and (step + 1) % train.eval_every == 0)):
                with logger.paused():  # evaluation time is not training throughput
                    val_loss = evaluate(model, eval_set, device, train.dtype)
                    logger.eval(step, val_loss)
    except BaseException:
        logger.close()
        raise

    records = logger.records
    first_interval = records[0]["interval_s"]
    later_steps = train.steps - 1
    later_time = logger.train_time_s - first_interval
    tokens_per_s = (later_steps * tokens_per_step / later_time if later_steps and later_time > 0
                    else tokens_per_step / max(first_interval, 1e-9))
    summary = {
        "first_loss": logger.losses[0],
        "final_loss": records[-1]["loss"],
        "val_loss": val_loss,
        "steps": train.steps,
        "tokens_per_s": tokens_per_s,
        "tokens": train.steps * tokens_per_step,
        "train_time_s": logger.train_time_s,
        "num_parameters": model.num_parameters(),
        "flops_per_token": flops_per_token,
        "device": str(device),
        "losses": list(logger.losses),
    }
    say(f"done  | {train.steps} steps in {format_duration(logger.train_time_s)} | loss "
        f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | val_loss "
        + ("n/a" if val_loss is None else f"{val_loss:.4f}") + f" | tok/s {tokens_per_s:,.0f}")
    logger.close({k: v for k, v in summary.items() if k != "losses"})
    return summary
