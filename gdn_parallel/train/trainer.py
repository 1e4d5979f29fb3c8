"""The training loop, one for every world size: a single process is the world-size-1 case.

    python -m gdn_parallel.train [--config FILE] [--resume auto|PATH]      (one process)
    torchrun --nproc_per_node=8 -m gdn_parallel.train --set parallel.tp=2 ...   (any launcher)

Per step: the dp replica's micro-batches (train.batch_size / train.microbatch_size rows of
train.seq_len tokens) go through `ParallelModel.train_step` (forward + backward, gradients reduced
over every mesh dimension), the global gradient norm is clipped, and AdamW steps, unless the loss or
the gradient norm is not finite: then the step is skipped (nothing applied) and counted, and
train.max_skipped_steps of them in a row stop the run. Validation (every train.eval_every steps and
at the end, on train.eval_rows fixed rows) runs under the same layout. Checkpoints go to
<train.out_dir>/checkpoints/step_<N>/ (checkpoint.interval, always after the last step, and when
SIGTERM or SIGINT asks the run to stop: the step in flight finishes, a checkpoint is saved at once,
without an evaluation, and the run ends normally). Resuming an older checkpoint into its own out_dir
moves the later ones aside (checkpoint/files.py).

Returns a summary dict: first_loss, final_loss, val_loss, steps, tokens_per_s, losses, ...
"""
from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import (
    CheckpointSaver,
    complete_checkpoints,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
)
from ..checkpoint.files import CONFIG_COPY, final_path, set_aside_after
from ..checkpoint.loading import CheckpointDamaged, pass_over, whole_problem
from ..checkpoint.manager import layout_record
from ..config import Config, ConfigError
from ..data import TokenBatches, check_vocabulary, load_dataset
from ..data.dataset import data_field
from ..data.tokenizer_record import tokenizer_files
from ..data.validation import validation_set
from ..model import HybridLM, build_model
from ..ops.triton_dispatch import check_kernel_config
from ..parallel.mesh import build_mesh
from ..parallel.parallelize import parallelize
from ..parallel.pipeline import parts_of_rank
from ..runtime.session import process_group
from .evaluation import evaluate, validation_text_bytes
from .optim import autocast_dtype, build_optimizer
from .progress import ProgressLogger, format_duration, peak_flops_per_s
from .schedule import check_resumed_schedule, schedule_from_config


class StopRequest:
    """SIGTERM / SIGINT ask the run to stop after the step in flight (all ranks agree each step)."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at each step)."""
        flag = torch.tensor([float(self.requested)], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
        raise ConfigError(f"train.out_dir={out_dir!r} cannot be written ({err.strerror or err}); choose a directory "
                          f"you can write (or '' to write nothing)") from None


def _check_data_size(dataset, config: Config) -> None:
    """One optimizer step must fit in the corpus: a smaller one would be repeated within every step."""
    train = config.train
    needed = config.parallel.dp * train.batch_size * train.seq_len
    have = dataset.train.num_tokens
    if have < needed:
        raise ConfigError(f"{data_field(config.data)} has {have:,} training tokens; one optimizer step "
                          f"takes parallel.dp x train.batch_size x train.seq_len = {config.parallel.dp} x "
                          f"{train.batch_size} x {train.seq_len} = {needed:,}: give more data, or lower "
                          f"train.seq_len or train.batch_size")


def _resume_point(resume: str | None, config: Config, say) -> Path | None:
    """The checkpoint to resume (verified; a collective), after the checks that need no model: a run
    already at train.steps, and a fresh run into an out_dir that holds another run's checkpoints."""
    train = config.train
    if not resume and train.out_dir and complete_checkpoints(train.out_dir):
        newest = complete_checkpoints(train.out_dir)[-1]
        raise ConfigError(f"train.out_dir={train.out_dir!r} already holds checkpoints (newest {newest.name}); "
                          f"continue that run with --resume auto, or start over in a new train.out_dir (or "
                          f"delete {newest.parent})")
    checkpoint = resolve_resume(resume, train.out_dir, say)
    while checkpoint is not None and read_trainer_state(checkpoint)["step"] >= train.steps:
        # It would end the run unread: verified whole first, so that a damaged one does not pass for it.
        problem = whole_problem(checkpoint)
        if problem is None:
            step = read_trainer_state(checkpoint)["step"]
            raise ConfigError(f"the checkpoint {checkpoint} is at step {step} and train.steps={train.steps}: "
                              f"nothing is left to train; raise train.steps (e.g. --steps {step + 1000}, with --set "
                              f"train.schedule_override=true where the schedule reads train.steps) to go on")
        if resume != "auto":
            raise CheckpointDamaged(checkpoint, problem)
        checkpoint = pass_over(checkpoint, problem, train.out_dir, say)
    return checkpoint


def _train(config: Config, device: torch.device, print_fn, resume) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    config.validate(world_size=world)
    train, pc = config.train, config.parallel
    check_kernel_config(config.model, device.type == "cuda", train.dtype)
    if train.dtype == "float16" and world > 1:
        raise ConfigError("train.dtype=float16 needs a loss scaler, which sharded training does not use here; "
                          "use bfloat16 or float32")
    is_main = rank == 0
    say = (print_fn or (lambda line: print(line, flush=True))) if is_main else (lambda line: None)
    if train.threads > 0:
        torch.set_num_threads(train.threads)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif train.dtype != "float32":
        say(f"note: train.dtype={train.dtype} applies to CUDA autocast; training in float32 on {device}")

    check_vocabulary(config.data, config.model.vocab_size)  # the data's largest id, from its metadata
    dataset = load_dataset(config.data)
    _check_data_size(dataset, config)
    checkpoint = _resume_point(resume, config, say)
    dims = build_mesh(pc, device.type, timedelta(seconds=train.collective_timeout_s))
    with torch.device("meta"):  # the whole model's size and work, without its memory
        skeleton = HybridLM(config.model)
    flops_per_token = float(skeleton.flops_per_token(train.seq_len))
    num_parameters = skeleton.num_parameters()
    # Only this pipeline rank's parts are built, each from its own seed: every layout starts from the
    # same weights, and no rank holds another stage's.
    parts = parts_of_rank(config.model, pc, dims.rank("pp"), train.seq_len)
    model = build_model(config.model, device, train.seed, keep=parts.__contains__)
    parallel = parallelize(model, dims, pc, device=device, seq_len=train.seq_len,
                           activation_checkpointing=train.activation_checkpointing)
    optimizer = build_optimizer(parallel.parameters(), train, device)
    schedule = schedule_from_config(train)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and train.dtype == "float16" else None
    amp_dtype = autocast_dtype(train.dtype, device)

    # One global stream of rows in a fixed order, cut into micro-batches of dp x rows: replica r takes the
    # r-th slice of each. Its position is saved, so a resume continues at the next unseen token under
    # any layout (gdn_parallel/data/stream.py).
    batches = TokenBatches.from_config(config.data, train.seq_len, train.microbatch_rows,
                                       dp_rank=dims.rank("dp"), dp_size=pc.dp, dataset=dataset)
    tokens_per_step = train.batch_size * train.seq_len * pc.dp

    say(f"data  | {dataset.describe()}")
    say(f"model | {num_parameters:,} parameters | layers {config.model.layer_types} | "
        f"hidden {config.model.hidden_size}")
    if world > 1:
        say(f"mesh  | pp {pc.pp} x dp {pc.dp} x cp {pc.cp} x tp {pc.tp} ({pc.data_parallel}, "
            f"cp {pc.cp_algorithm}, sp {pc.sequence_parallel}, {train.microbatches} micro-batches) on "
            f"{world} {device.type} processes")
    say(f"train | device {device} | dtype {train.dtype} | threads {torch.get_num_threads()} | "
        f"{train.steps} steps x {train.batch_size} x {train.seq_len} tokens | lr {train.lr:g} "
        f"{train.lr_schedule} warmup {train.warmup_steps}")
    # The replicas share one fixed validation set, as they share a training batch.
    val_steps = _validation_steps(dataset, config, dims.rank("dp"), device, say)
    val_text_bytes = validation_text_bytes(dataset, config, say) if val_steps else None   # val_bpb's
    if train.out_dir and is_main:
        Path(train.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(train.out_dir) / CONFIG_COPY).write_text(config.to_yaml(), encoding="utf-8")

    start_step = 0
    if resume and checkpoint is None:
        say(f"resume | no checkpoint under {train.out_dir}/checkpoints yet: starting from step 0")
    if checkpoint is not None:
        here = layout_record(config, world)
        checkpoint, saved = _load(checkpoint, resume, parallel, optimizer, dims, config, say)
        start_step = int(saved["step"])
        check_resumed_schedule(saved["config"], train, start_step, say)
        batches.load_state_dict(saved["data"]["stream"])
        say(f"resume | {checkpoint} | step {start_step}" + ("" if saved.get("layout") == here
                                                           else f" | saved under {saved.get('layout')}"))
        _roll_back(train.out_dir, start_step, say)
    saver = (CheckpointSaver(train.out_dir, config.checkpoint.keep, config.checkpoint.async_save,
                             attachments=tokenizer_files(dataset),   # exports name the data's tokenizer
                             timeout=timedelta(seconds=train.collective_timeout_s))
             if config.checkpoint.enabled and train.out_dir else None)
    logger = ProgressLogger(train.steps, train.log_every, tokens_per_step, device,
                            flops_per_token=flops_per_token,
                            peak_flops=_cluster_peak(train, device, world),
                            out_dir=train.out_dir if is_main else "", print_fn=say,
                            first_step=start_step, append=checkpoint is not None,
                            log=config.log if is_main else None, run_config=config.to_dict())
    say = logger.say if is_main else say  # lines above the progress bar, when there is one
    stop = StopRequest()
    clip = train.grad_clip if train.grad_clip > 0 else math.inf
    val_loss, skipped_in_row, step = None, 0, start_step - 1
    try:
        for step in range(start_step, train.steps):
            microbatches = [next(batches).to(device, non_blocking=True) for _ in range(train.microbatches)]
            lr = schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = parallel.train_step(microbatches, autocast_dtype=amp_dtype, scaler=scaler)
            if scaler is not None:
                scaler.unscale_(optimizer)
            grad_norm = parallel.clip_grad_norm(clip)
            finite = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))  # global values: ranks agree
            if finite or scaler is not None:  # the scaler skips non-finite fp16 steps itself
                skipped_in_row = 0
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not finite and scaler is None:
                skipped_in_row += 1
                _skip(logger, say, step, loss, grad_norm, skipped_in_row, train.max_skipped_steps)
            else:
                logger.step(step, loss, lr, grad_norm)
            last = step == train.steps - 1
            stopping = stop.agreed(device) and not last
            # A stop goes straight to its checkpoint: a scheduler's SIGKILL follows its SIGTERM within a
            # grace period (torchrun's and Slurm's default: 30 s) that an evaluation would only shorten.
            if val_steps and not stopping and (last or (train.eval_every and (step + 1) % train.eval_every == 0)):
                with logger.paused():  # evaluation time is not training throughput
                    result = evaluate(parallel, val_steps, train.seq_len, amp_dtype, val_text_bytes)
                    val_loss = result["val_loss"]
                    logger.eval(step, val_loss, result["val_loss_by_position"], result["val_bpb"])
            if saver is not None:
                saver.poll()
                interval = config.checkpoint.interval
                if last or stopping or (interval and (step + 1) % interval == 0):
                    with logger.paused():
                        _save(saver, step + 1, parallel, optimizer, dims, config, batches, logger, say)
            if stopping:
                say(f"stop  | a stop was asked for: ended after step {step} "
                    + ("with a checkpoint" if saver is not None else "(no train.out_dir: no checkpoint)"))
                break
        if saver is not None:
            saver.finish()
    except BaseException:
        logger.close()
        raise
    finally:
        stop.restore()
    return _summary(logger, train, step, start_step, tokens_per_step, val_loss, num_parameters, flops_per_token,
                    device, say)


def _validation_steps(dataset, config: Config, dp_rank: int, device: torch.device, say) -> list[list]:
    """This replica's share of the fixed validation set (train.eval_rows rows, the same under every
    layout: data/validation.py), on the training device once, like the training micro-batches."""
    train, data = config.train, config.data
    if len(dataset.val) == 0:
        return []
    found = validation_set(dataset.val, train.seq_len, train.eval_rows, rows_per_micro_batch=train.microbatch_rows,
                           micro_batches=train.microbatches, dp_rank=dp_rank, dp_size=config.parallel.dp,
                           seed=data.seed, packing=data.packing)
    say(f"eval  | {found.rows} rows x {train.seq_len} tokens ({found.tokens:,} tokens) every "
        + (f"{train.eval_every} steps and " if train.eval_every else "") + "at the end"
        + (f" | the validation split holds only {found.split_tokens:,} tokens (train.eval_rows={train.eval_rows} "
           f"asks for {train.eval_rows * train.seq_len:,}): all of them" if found.capped else ""))
    return [[row.to(device) for row in step] for step in found.steps]


def _skip(logger, say, step, loss, grad_norm, in_row: int, limit: int) -> None:
    reason = f"loss {float(loss):.4g}, grad_norm {float(grad_norm):.4g}"
    say(f"skip  | step {step}: non-finite ({reason}); nothing applied ({in_row} in a row, limit {limit})")
    logger.record({"step": step, "skipped_step": True, "reason": reason})
    if in_row >= limit:
        raise TrainingDiverged(
            f"{in_row} steps in a row had a non-finite loss or gradient (last: step {step}, {reason}); stopping. "
            f"Lower train.lr or raise train.warmup_steps, check train.dtype, or resume from the last checkpoint "
            f"with --resume auto")


def _load(checkpoint: Path, resume: str, parallel, optimizer, dims, config: Config, say):
    """(checkpoint, its trainer state) loaded into the model and optimizer. Under --resume auto a
    checkpoint whose data fails the verification made while it loads is passed over, said, and the
    next older one that verifies is loaded instead (over what was loaded)."""
    here = layout_record(config, dist.get_world_size())
    while True:
        try:
            return checkpoint, load_checkpoint(checkpoint, parallel.named_parameters(), optimizer, dims, config,
                                               same_layout=lambda saved: saved.get("layout") == here)
        except CheckpointDamaged as damaged:
            if resume != "auto":
                raise
            checkpoint = pass_over(checkpoint, damaged.problem, config.train.out_dir, say)


def _roll_back(out_dir: str, step: int, say) -> None:
    """Resuming step `step` where later checkpoints exist starts a new line of the run: the later
    ones are moved aside (named), so that neither --resume auto nor pruning mistakes them for it."""
    if not out_dir:
        return
    moved = set_aside_after(out_dir, step) if dist.get_rank() == 0 else []
    if moved:
        say(f"resume | rolled back to step {step}: the later checkpoint(s) {', '.join(p.name for p in moved)} "
            f"of the abandoned line moved to {moved[0].parent}")
    if dist.get_world_size() > 1:
        dist.barrier()  # no rank saves into checkpoints/ while rank 0 moves them


def _save(saver, completed: int, parallel, optimizer, dims, config: Config, batches, logger, say) -> None:
    # The stream's position is the same on every rank: the global token count consumed.
    saver.save(completed, parallel.named_parameters(), optimizer, dims, config, batches.state_dict())
    where = str(final_path(config.train.out_dir, completed))
    say(f"save  | {where}" + (" (writing in the background)" if config.checkpoint.async_save else ""))
    logger.record({"step": completed - 1, "checkpoint": where})


def _cluster_peak(train, device, world_size: int):
    peak = peak_flops_per_s(train, device)
    return None if peak is None else peak * world_size


def _summary(logger, train, last_step: int, start_step: int, tokens_per_step: int, val_loss, num_parameters,
             flops_per_token, device, say) -> dict:
    records = logger.records
    steps_run = last_step - start_step + 1
    first_interval = records[0]["interval_s"] if records else 0.0
    later_time = logger.train_time_s - first_interval
    later_steps = steps_run - (records[0]["interval_steps"] if records else 0)
    tokens_per_s = (later_steps * tokens_per_step / later_time if later_steps > 0 and later_time > 0
                    else tokens_per_step / max(first_interval, 1e-9))
    losses = list(logger.losses)
    summary = {
        "first_loss": losses[0] if losses else None,
        "final_loss": records[-1]["loss"] if records else None,
        "val_loss": val_loss,
        "steps": last_step + 1,
        "start_step": start_step,
        "tokens_per_s": tokens_per_s,
        "tokens": steps_run * tokens_per_step,
        "train_time_s": logger.train_time_s,
        "num_parameters": num_parameters,
        "flops_per_token": flops_per_token,
        "device": str(device),
        "losses": losses,
    }
    first = "n/a" if summary["first_loss"] is None else f"{summary['first_loss']:.4f}"
    final = "n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    say(f"done  | {steps_run} steps in {format_duration(logger.train_time_s)} | loss {first} -> {final} | "
        f"val_loss " + ("n/a" if val_loss is None else f"{val_loss:.4f}") + f" | tok/s {tokens_per_s:,.0f}")
    logger.close({k: v for k, v in summary.items() if k != "losses"})
    return summary
