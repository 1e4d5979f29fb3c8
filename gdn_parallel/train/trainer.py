"""The training loop, one for every world size: a single process is the world-size-1 case.

    python -m gdn_parallel.train [--config FILE] [--resume auto|PATH]      (one process)
    torchrun --nproc_per_node=8 -m gdn_parallel.train --set parallel.tp=2 ...   (any launcher)

Per step: the dp replica's micro-batches (train.batch_size / train.microbatch_size rows of
train.seq_len tokens) go through `ParallelModel.train_step` (forward + backward, gradients reduced
over every mesh dimension), the global gradient norm is clipped, and AdamW steps, unless the loss or
the gradient norm is not finite: then the step is skipped (nothing applied) and counted, and
train.max_skipped_steps of them in a row stop the run (with a fused AdamW the skip is decided on the
device and booked on the host a step later: step_outcome.py). Validation (every train.eval_every steps and
at the end, on train.eval_rows fixed rows) runs under the same layout. Checkpoints go to
<train.out_dir>/checkpoints/step_<N>/ (checkpoint.interval, always after the last step, and when
SIGTERM or SIGINT asks the run to stop: the step in flight finishes, a checkpoint is saved at once,
without an evaluation, and the run ends normally). Resuming an older checkpoint into its own out_dir
moves the later ones aside (checkpoint/files.py).

The set-up (data, model, resume, logger) is run_setup.py; what the steps share, run_state.py. Here:
the loop, its steps (the optimizer step, an evaluation, a checkpoint) and the summary.

Returns a summary dict: first_loss, final_loss, val_loss, steps, tokens_per_s, losses, ...
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError
from ..checkpoint.state import rank_tensors
from ..config import Config, ConfigError
from ..model import check_layers
from ..parallel.tensor import local_tensor
from ..runtime.session import process_group
from .evaluation import evaluate
from .progress import format_duration
from .run_setup import set_up_run
from .run_state import RunState
from .step_outcome import applied_outcome, step_unless_non_finite
from .stop_request import StopRequest


class TrainingDiverged(FloatingPointError):
    """train.max_skipped_steps steps in a row had a non-finite loss or gradient: the run stopped."""


def run_training(config: Config, print_fn: Callable[[str], None] | None = None,
                 resume: str | None = None) -> dict:
    config.validate()
    _make_out_dir(config.train.out_dir)
    with process_group(config.train) as (device, _launched):
        return _train(config, device, print_fn, resume)


def _make_out_dir(out_dir: str) -> None:
    """Create train.out_dir on every rank before any group exists: a path that cannot be made (under
    /proc, a read-only or full file system) fails here, on every rank, naming the field."""
    if not out_dir:
        return
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(out_dir) / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"train.out_dir={out_dir!r} cannot be written ({err.strerror or err}); choose a "
                          f"directory you can write (or '' to write nothing)") from None


def _train(config: Config, device: torch.device, print_fn, resume) -> dict:
    world = dist.get_world_size()
    config.validate(world_size=world)
    # the layer pattern's rules (config cannot know mixers), cp and chunked recompute included
    check_layers(config.model, config.parallel.tp, config.parallel.cp, config.train.recompute_chunks)
    run = set_up_run(config, device, print_fn, resume)
    if run.resumed_from is not None and not _state_is_finite(run):
        raise CheckpointError(f"{run.resumed_from} holds parameters or optimizer moments that are not "
                              f"finite: it is damaged or was saved from a diverged run; resume an earlier "
                              f"checkpoint (--resume PATH)")
    stop = StopRequest.for_device(device)
    try:
        for step in range(run.start_step, config.train.steps):
            if not _run_step(run, step, stop):
                break
        if run.profiler is not None:
            run.profiler.close()
        if run.saver is not None:
            _finish_saving(run)
    except BaseException:
        run.logger.close()
        raise
    finally:
        stop.restore()
        run.compile_watch.close()
    return _summary(run)


def _run_step(run: RunState, step: int, stop: StopRequest) -> bool:
    """One optimizer step, then an evaluation and a checkpoint where due; False when a stop was asked
    for (the run ends after this step, its checkpoint saved)."""
    train = run.config.train
    with run.profiler.around(step) if run.profiler is not None else contextlib.nullcontext():
        _optimizer_step(run, step)
    last = step == train.steps - 1
    stopping = stop.agreed(run.device) and not last
    evaluating = bool(run.validation.steps) and not stopping and (last or _due_every(train.eval_every, step))
    saving = run.saver is not None and (last or stopping or _due_every(run.config.checkpoint.interval, step))
    if last or stopping or evaluating or saving:
        _settle(run)  # the step is booked (and a run stopped by skipped steps stops) before these
    # A stop goes straight to its checkpoint: a scheduler's SIGKILL follows its SIGTERM within a
    # grace period (torchrun's and Slurm's default: 30 s) that an evaluation would only shorten.
    if evaluating:
        _evaluate(run, step)
    if run.saver is not None:
        with run.logger.paused():  # publishing a finished background save is checkpointing, not training
            run.saver.poll()
        if saving:
            _save(run, step)
    if stopping:
        run.say(f"stop  | a stop was asked for: ended after step {step} "
                + ("with a checkpoint" if run.saver is not None else "(no train.out_dir: no checkpoint)"))
    return not stopping


def _due_every(interval: int, step: int) -> bool:
    """Whether something done every `interval` steps (0: never) is due after `step`."""
    return interval != 0 and (step + 1) % interval == 0


def _optimizer_step(run: RunState, step: int) -> None:
    """Step `step`: forward and backward over this replica's micro-batches, the gradient clipped, and
    AdamW applied, unless the loss or gradient norm is not finite (then skipped, and counted)."""
    train, optimizer, scaler = run.config.train, run.optimizer, run.scaler
    run.last_step = step
    run.beside_save |= run.saver is not None and run.saver.in_flight
    microbatches = [next(run.batches).to(run.device, non_blocking=True) for _ in range(train.microbatches)]
    lr = run.schedule(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if run.pending is not None and run.logger.due(run.pending.step):
        _settle(run)  # the previous step prints a line, which reads the device anyway: before this step
    loss = run.parallel.train_step(microbatches, autocast_dtype=run.autocast_dtype, scaler=scaler)
    _settle(run)  # with this step queued, the host waits for the previous step's flag, not the GPU
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = run.parallel.clip_grad_norm(train.grad_clip if train.grad_clip > 0 else math.inf)
    if scaler is not None:  # the scaler skips non-finite float16 steps itself
        scaler.step(optimizer)
        scaler.update()
        run.pending = applied_outcome(step, loss, lr, grad_norm)
    else:  # loss and norm are global values: every rank skips alike
        run.pending = step_unless_non_finite(optimizer, step, loss, lr, grad_norm)
    run.pending.flops = _step_flops(run, microbatches)
    optimizer.zero_grad(set_to_none=True)


def _step_flops(run: RunState, microbatches: list) -> float | None:
    """The step's training FLOPs over every replica, from the documents of this replica's rows (their
    lengths decide the attention's share, model/flops.py), taken as every replica's share."""
    if run.size.flops is None:
        return None
    pieces = [length for batch in microbatches for length in batch.cu_seqlens.diff().tolist()]
    return run.size.flops.of_pieces(pieces) * run.tokens_per_step / sum(pieces)


def _settle(run: RunState) -> None:
    """Book the step still pending (step_outcome.py): counted and logged, or counted as skipped."""
    outcome, run.pending = run.pending, None
    if outcome is None:
        return
    if outcome.applied():
        run.skipped_in_row = 0
        run.logger.step(outcome.step, outcome.loss, outcome.lr, outcome.grad_norm, flops=outcome.flops)
    else:
        run.skipped_in_row += 1
        _skip(run, outcome.step, outcome.loss, outcome.grad_norm)


def _skip(run: RunState, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Say and record a skipped step; train.max_skipped_steps of them in a row stop the run."""
    in_row, limit = run.skipped_in_row, run.config.train.max_skipped_steps
    reason = f"loss {float(loss):.4g}, grad_norm {float(grad_norm):.4g}"
    run.say(f"skip  | step {step}: non-finite ({reason}); nothing applied ({in_row} in a row, limit {limit})")
    run.logger.record({"step": step, "skipped_step": True, "reason": reason})
    if step == run.start_step and run.resumed_from is not None:
        raise TrainingDiverged(
            f"the first step after resuming {run.resumed_from} is not finite ({reason}): the state that "
            f"checkpoint holds is damaged or diverged; resume an earlier checkpoint (--resume PATH)")
    if in_row >= limit:
        raise TrainingDiverged(
            f"{in_row} steps in a row had a non-finite loss or gradient (last: step {step}, {reason}); "
            f"stopping. Lower train.lr or raise train.warmup_steps, check train.dtype, or resume from the "
            f"last checkpoint with --resume auto")


def _state_is_finite(run: RunState) -> bool:
    """Every rank's parameters and optimizer slots (what a checkpoint holds) are finite (one reduction
    a rank, then a MIN over the ranks: a collective)."""
    flags = [torch.isfinite(local_tensor(value)).all().to(run.device)
             for _, value, _ in rank_tensors(run.parallel.named_parameters(), run.optimizer) if value.numel()]
    finite = torch.stack(flags).all() if flags else torch.tensor(True)
    agreed = finite.to(device=run.device, dtype=torch.int32).reshape(1)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def _evaluate(run: RunState, step: int) -> None:
    with run.logger.paused():  # evaluation time is not training throughput
        start = time.perf_counter()
        result = evaluate(run.parallel, run.validation.steps, run.config.train.seq_len, run.autocast_dtype,
                          run.validation.text_bytes)
        run.val_loss = result["val_loss"]
        run.logger.eval(step, run.val_loss, result["val_loss_by_position"], result["val_bpb"],
                        seconds=time.perf_counter() - start)


def _save(run: RunState, step: int) -> None:
    """The checkpoint after `step` (step + 1 completed steps); its time is not training throughput.
    A state that is not finite is never saved: the run stops instead."""
    with run.logger.paused():
        if not _state_is_finite(run):
            raise TrainingDiverged(
                f"after step {step} the parameters or optimizer moments are not finite: no checkpoint is "
                f"written from them; resume the newest checkpoint (--resume auto)")
        # The stream's position is the same on every rank: the global token count consumed.
        where = str(run.saver.save(step + 1, run.parallel.named_parameters(), run.optimizer, run.dims,
                                   run.config, run.batches.state_dict(), **run.checkpoint_entries))
        run.say(f"save  | {where}"
                + (" (writing in the background)" if run.config.checkpoint.async_save else ""))
        run.logger.record({"step": step, "checkpoint": where})


def _finish_saving(run: RunState) -> None:
    """Wait for the last background save to be written and published, and say how long that took."""
    if not run.saver.in_flight:
        return
    start = time.perf_counter()
    run.saver.finish()
    run.say(f"save  | the last checkpoint written {time.perf_counter() - start:.1f} s after the run's end")


def _summary(run: RunState) -> dict:
    """The run's summary: said, written as the last metrics record, and returned (losses too)."""
    logger = run.logger
    records, losses = logger.records, list(logger.losses)
    steps_run = run.last_step - run.start_step + 1
    tokens_per_s = _tokens_per_s(run, steps_run)
    summary = {
        "first_loss": losses[0] if losses else None,
        "final_loss": records[-1]["loss"] if records else None,
        "val_loss": run.val_loss,
        "steps": run.last_step + 1,
        "start_step": run.start_step,
        "tokens_per_s": tokens_per_s,
        "tokens": steps_run * run.tokens_per_step,
        "train_time_s": logger.train_time_s,
        "num_parameters": run.size.num_parameters,
        "flops_per_token": run.size.flops_per_token,
        "device": str(run.device),
        "losses": losses,
    }
    first = "n/a" if summary["first_loss"] is None else f"{summary['first_loss']:.4f}"
    final = "n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    val_loss = "n/a" if run.val_loss is None else f"{run.val_loss:.4f}"
    run.say(f"done  | {steps_run} steps in {format_duration(logger.train_time_s)} | loss {first} -> {final} "
            f"| val_loss {val_loss} | tok/s {tokens_per_s:,.0f}")
    logger.close({k: v for k, v in summary.items() if k != "losses"})
    return summary


def _tokens_per_s(run: RunState, steps_run: int) -> float:
    """Throughput of the steps after the first line's interval (which holds compilation and warm-up),
    or of that interval alone when nothing came after it."""
    records, tokens_per_step = run.logger.records, run.tokens_per_step
    first_interval = records[0]["interval_s"] if records else 0.0
    later_time = run.logger.train_time_s - first_interval
    later_steps = steps_run - (records[0]["interval_steps"] if records else 0)
    return (later_steps * tokens_per_step / later_time if later_steps > 0 and later_time > 0
            else tokens_per_step / max(first_interval, 1e-9))
