"""A training run's set-up, before its first step (trainer.py runs the steps): the checks that need no
model, the data, the checkpoint to resume, the model under its layout, the optimizer, the validation
set, the saver and the progress logger, gathered in one RunState (run_state.py).

The start-up lines (data, model, mesh, train, eval, resume) are printed here, by rank 0.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import (
    CheckpointError,
    CheckpointSaver,
    complete_checkpoints,
    load_checkpoint,
    ranks,
    read_trainer_state,
    resolve_resume,
)
from ..checkpoint.files import CONFIG_COPY, set_aside_after, write_run_record
from ..checkpoint.loading import CheckpointDamaged, RunIdentity, pass_over, run_identity, whole_problem
from ..checkpoint.manager import layout_record
from ..config import Config, ConfigError
from ..data import TokenBatches, check_vocabulary, load_dataset
from ..data.dataset import data_field
from ..data.tokenizer_record import tokenizer_files
from ..data.validation import validation_set
from ..model import HybridLM, build_model, check_kernels, residual_stream_dtype
from ..parallel.mesh import build_mesh
from ..parallel.parallelize import parallelize
from ..parallel.pipeline import parts_of_rank, uneven_split_line
from .evaluation import validation_text_bytes
from .memory_model import PREDICTION_ERROR, predict_peak, settings_that_fit
from .optim import autocast_dtype, build_optimizer
from .profiling import StepProfiler
from .progress import PhaseClock, ProgressLogger, ProgressSettings, alloc_retries, peak_flops_per_s
from .run_state import ModelSize, RunState, Validation
from .schedule import check_resumed_schedule, schedule_from_config


def set_up_run(config: Config, device: torch.device, print_fn: Callable[[str], None] | None,
               resume: str | None) -> RunState:
    """Everything the steps need, in the order the start-up lines are printed (a collective: every rank
    calls it). `config` is validated for this world; `resume`: --resume (auto, a path, or None)."""
    say = _rank_zero_printer(print_fn)
    clock = PhaseClock()                    # where the set-up's seconds go: the start-up line
    _prepare_process(config, device, say)
    clock.mark("checks")
    dataset = _checked_dataset(config)
    clock.mark("data")
    checkpoint = _resume_point(resume, config, say)
    clock.mark("resume point")
    run = _build_run(config, device, dataset, say, clock)
    _announce(run, dataset)
    # The replicas share one fixed validation set, as they share a training batch.
    steps = validation_steps(dataset, config, run.dims.rank("dp"), device, say)
    run.validation = Validation(steps, validation_text_bytes(dataset, config, say) if steps else None)
    _write_config_copy(config)
    clock.mark("validation set")
    resumed = _resume(run, checkpoint, resume)
    run.saver = _saver(config, dataset)
    clock.mark("checkpoint load" if resumed else "saver")
    run.logger = _progress_logger(run, resumed, clock.phases)
    if dist.get_rank() == 0:
        run.say = run.logger.say  # lines above the progress bar, when there is one
    run.profiler = StepProfiler(config.train.profile_window, config.train.out_dir, dist.get_rank(), device,
                                run.say)
    return run


def _rank_zero_printer(print_fn: Callable[[str], None] | None) -> Callable[[str], None]:
    if dist.get_rank() != 0:
        return lambda line: None
    return print_fn or (lambda line: print(line, flush=True))


def _prepare_process(config: Config, device: torch.device, say) -> None:
    """The checks of the config against this machine and world, and the process's torch settings."""
    train = config.train
    check_kernels(config.model, device.type == "cuda")
    if train.dtype == "float16" and dist.get_world_size() > 1:
        raise ConfigError("train.dtype=float16 needs a loss scaler, which sharded training does not use "
                          "here; use bfloat16 or float32")
    if train.threads > 0:
        torch.set_num_threads(train.threads)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _check_memory(config, device, say)
    elif train.dtype != "float32":
        say(f"note: train.dtype={train.dtype} applies to CUDA autocast; training in float32 on {device}")


def _check_memory(config: Config, device: torch.device, say) -> None:
    """The predicted peak against the GPU's memory: printed, and a run that cannot fit refused."""
    capacity = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    predicted = predict_peak(config)
    say(f"mem   | {predicted.summary(capacity)}")
    if predicted.peak_gib <= capacity:
        return
    fits = settings_that_fit(config, capacity)
    advice = (f"with {', '.join(fits)} it is predicted to fit" if fits
              else "no setting tried fits: use more GPUs per sequence (parallel.cp) or a shorter "
                   "train.seq_len")
    message = (f"train.seq_len={config.train.seq_len} x {config.train.microbatch_rows} rows: predicted peak "
               f"{predicted.peak_gib:.1f} GiB exceeds the GPU's {capacity:.1f} GiB; {advice}")
    if config.train.memory_check and predicted.peak_gib > capacity * (1 + PREDICTION_ERROR):
        raise ConfigError(message + " (train.memory_check=false tries it anyway)")
    say(f"warning: {message}; within the prediction's error, so trying it")


def _checked_dataset(config: Config):
    check_vocabulary(config.data, config.model.vocab_size)  # the data's largest id, from its metadata
    dataset = load_dataset(config.data)
    _check_data_size(dataset, config)
    return dataset


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
    already at train.steps, a fresh run into an out_dir that holds another run's checkpoints, and
    another run's checkpoint resumed into this out_dir (loading.run_identity)."""
    train = config.train
    if not resume and train.out_dir and complete_checkpoints(train.out_dir):
        newest = complete_checkpoints(train.out_dir)[-1]
        raise ConfigError(f"train.out_dir={train.out_dir!r} already holds checkpoints (newest "
                          f"{newest.name}); continue that run with --resume auto, or start over in a new "
                          f"train.out_dir (or delete {newest.parent})")
    unverified_ok = not config.checkpoint.verify
    checkpoint = resolve_resume(resume, train.out_dir, say, unverified_ok)
    while checkpoint is not None:
        # Read-only on every rank: run_id.json is written only once the checkpoint is loaded (_resume).
        run_identity(train.out_dir, checkpoint, config.checkpoint.allow_other_run, resume)
        if read_trainer_state(checkpoint)["step"] < train.steps:
            break
        # It would end the run unread: verified whole first, so that a damaged one does not pass for it.
        problem = whole_problem(checkpoint, unverified_ok)
        if problem is None:
            step = read_trainer_state(checkpoint)["step"]
            raise ConfigError(f"the checkpoint {checkpoint} is at step {step} and train.steps="
                              f"{train.steps}: nothing is left to train; raise train.steps (e.g. --steps "
                              f"{step + 1000}, with --set train.schedule_override=true where the schedule "
                              f"reads train.steps) to go on")
        if resume != "auto":
            raise CheckpointDamaged(checkpoint, problem)
        checkpoint = pass_over(checkpoint, problem, train.out_dir, say, unverified_ok)
    return checkpoint


def _build_run(config: Config, device: torch.device, dataset, say, clock: PhaseClock) -> RunState:
    """The model under its layout, its optimizer, schedule and precision, and this replica's batches."""
    train, pc = config.train, config.parallel
    dims = build_mesh(pc, device.type, timedelta(seconds=train.collective_timeout_s))
    clock.mark("mesh")
    with torch.device("meta"):  # the whole model's size and work, without its memory
        skeleton = HybridLM(config.model)
    flops = skeleton.training_flops()
    size = ModelSize(skeleton.num_parameters(), flops.per_token(train.seq_len), flops)
    # Only this pipeline rank's parts are built, each from its own seed: every layout starts from the
    # same weights, and no rank holds another stage's.
    parts = parts_of_rank(config.model, pc, dims.rank("pp"), train.seq_len)
    model = build_model(config.model, device, train.seed, keep=parts.__contains__)
    clock.mark("model")
    stream_dtype = residual_stream_dtype(config.model, autocast_dtype(train.dtype, device))
    parallel = parallelize(model, dims, pc, device=device, seq_len=train.seq_len,
                           activation_checkpointing=train.activation_checkpointing,
                           activation_offload=train.activation_offload,
                           activation_offload_blocks=train.activation_offload_blocks,
                           recompute_chunks=train.recompute_chunks,
                           stream_dtype=stream_dtype)
    clock.mark("parallelize")
    optimizer = build_optimizer(parallel.parameters(), train, device)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and train.dtype == "float16" else None
    # One global stream of rows in a fixed order, cut into micro-batches of dp x rows: replica r takes the
    # r-th slice of each. Its position is saved, so a resume continues at the next unseen token under
    # any layout (gdn_parallel/data/stream.py).
    batches = TokenBatches.from_config(config.data, train.seq_len, train.microbatch_rows,
                                       dp_rank=dims.rank("dp"), dp_size=pc.dp, dataset=dataset)
    clock.mark("optimizer + batches")
    return RunState(config=config, device=device, say=say, dims=dims, parallel=parallel, optimizer=optimizer,
                    schedule=schedule_from_config(train), scaler=scaler,
                    autocast_dtype=autocast_dtype(train.dtype, device), batches=batches, size=size)


def _announce(run: RunState, dataset) -> None:
    """The start-up lines: the data, the model, the mesh (several processes) and the training."""
    config, say, world = run.config, run.say, dist.get_world_size()
    train, pc = config.train, config.parallel
    say(f"data  | {dataset.describe()}")
    say(f"model | {run.size.num_parameters:,} parameters | layers {config.model.layer_types} | "
        f"hidden {config.model.hidden_size}")
    if world > 1:
        say(f"mesh  | pp {pc.pp} x dp {pc.dp} x cp {pc.cp} x tp {pc.tp} ({pc.data_parallel}, "
            f"cp {pc.cp_algorithm}, {pc.cp_attention_split} attention, sp {pc.sequence_parallel}, "
            f"{train.microbatches} micro-batches) on "
            f"{world} {run.device.type} processes")
        split = uneven_split_line(config.model, pc, train.seq_len)
        if split is not None:
            say(split)
    say(f"train | device {run.device} | dtype {train.dtype} | threads {torch.get_num_threads()} | "
        f"{train.steps} steps x {train.batch_size} x {train.seq_len} tokens | lr {train.lr:g} "
        f"{train.lr_schedule} warmup {train.warmup_steps}")


def validation_steps(dataset, config: Config, dp_rank: int, device: torch.device, say) -> list[list]:
    """This replica's share of the fixed validation set (train.eval_rows rows, the same under every
    layout: data/validation.py), on the training device once, like the training micro-batches."""
    train, data = config.train, config.data
    if len(dataset.val) == 0:
        return []
    found = validation_set(dataset.val, train.seq_len, train.eval_rows,
                           rows_per_micro_batch=train.microbatch_rows, micro_batches=train.microbatches,
                           dp_rank=dp_rank, dp_size=config.parallel.dp, seed=data.seed, packing=data.packing)
    say(f"eval  | {found.rows} rows x {train.seq_len} tokens ({found.tokens:,} tokens) every "
        + (f"{train.eval_every} steps and " if train.eval_every else "") + "at the end"
        + (f" | the validation split holds only {found.split_tokens:,} tokens (train.eval_rows="
           f"{train.eval_rows} asks for {train.eval_rows * train.seq_len:,}): all of them"
           if found.capped else ""))
    return [[row.to(device) for row in step] for step in found.steps]


def _write_config_copy(config: Config) -> None:
    """The resolved config beside the run's outputs (rank 0)."""
    out_dir = config.train.out_dir
    if out_dir and dist.get_rank() == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / CONFIG_COPY).write_text(config.to_yaml(), encoding="utf-8")


def _resume(run: RunState, checkpoint: Path | None, resume: str | None) -> bool:
    """Load `checkpoint` (None: a fresh start) into the run: its weights, optimizer, step, schedule and
    data position; whether one was loaded."""
    train = run.config.train
    if resume and checkpoint is None:
        run.say(f"resume | no checkpoint under {train.out_dir}/checkpoints yet: starting from step 0")
    if checkpoint is None:
        _settle_identity(run, None, resume)
        return False
    here = layout_record(run.config, dist.get_world_size())
    checkpoint, saved = _load(run, checkpoint, resume, here)
    identity = _settle_identity(run, checkpoint, resume)
    run.start_step = int(saved["step"])
    run.last_step = run.start_step - 1
    run.resumed_from = checkpoint
    check_resumed_schedule(saved["config"], train, run.start_step, run.say)
    run.batches.load_state_dict(saved["data"]["stream"])
    run.say(f"resume | {checkpoint} | step {run.start_step}"
            + ("" if saved.get("layout") == here else f" | saved under {saved.get('layout')}")
            + (f" | {identity.said}" if identity.said else ""))
    _roll_back(train.out_dir, run.start_step, run.say)
    return True


def _load(run: RunState, checkpoint: Path, resume: str | None, here: dict):
    """(checkpoint, its trainer state) loaded into the model and optimizer; `here`: this run's layout
    record. Under --resume auto a checkpoint whose data fails the verification made while it loads is
    passed over, said, and the next older one that verifies is loaded instead (over what was loaded)."""
    while True:
        try:
            return checkpoint, load_checkpoint(checkpoint, run.parallel.named_parameters(), run.optimizer,
                                               run.dims, run.config,
                                               same_layout=lambda saved: saved.get("layout") == here)
        except CheckpointDamaged as damaged:
            if resume != "auto":
                raise
            checkpoint = pass_over(checkpoint, damaged.problem, run.config.train.out_dir, run.say,
                                   not run.config.checkpoint.verify)


def _settle_identity(run: RunState, checkpoint: Path | None, resume: str | None) -> RunIdentity:
    """The run's identity (loading.run_identity), decided by rank 0, which writes run_id.json where the
    out_dir has none yet, and given to every rank (a collective): each checkpoint records it. Decided
    after the load: a checkpoint passed over while loading is not the one resumed, and another run's
    checkpoint reached that way is refused here, before anything is trained or written."""
    config = run.config

    def decide() -> RunIdentity | None:
        if dist.get_rank() != 0:
            return None
        identity = run_identity(config.train.out_dir, checkpoint, config.checkpoint.allow_other_run, resume)
        if identity.new_record is not None:
            write_run_record(config.train.out_dir, identity.new_record)
        return identity
    mine = ranks.agree(decide, CheckpointError)
    identity = ranks.gathered(mine)[0]
    run.checkpoint_entries = identity.checkpoint_entries()
    return identity


def _roll_back(out_dir: str, step: int, say) -> None:
    """Resuming step `step` where later checkpoints exist starts a new line of the run: the later
    ones are moved aside (named), so that neither --resume auto nor pruning mistakes them for it."""
    if not out_dir:
        return
    moved = set_aside_after(out_dir, step) if dist.get_rank() == 0 else []
    if moved:
        names = ", ".join(p.name for p in moved)
        say(f"resume | rolled back to step {step}: the later checkpoint(s) {names} of the abandoned line "
            f"moved to {moved[0].parent}")
    if dist.get_world_size() > 1:
        dist.barrier()  # no rank saves into checkpoints/ while rank 0 moves them


def _saver(config: Config, dataset) -> CheckpointSaver | None:
    """The run's checkpoint saver (every rank makes it: an asynchronous one makes a group); None when
    no checkpoints are written."""
    train = config.train
    if not (config.checkpoint.enabled and train.out_dir):
        return None
    return CheckpointSaver(train.out_dir, config.checkpoint.keep, config.checkpoint.async_save,
                           attachments=tokenizer_files(dataset),   # exports name the data's tokenizer
                           timeout=timedelta(seconds=train.collective_timeout_s))


def _progress_logger(run: RunState, resumed: bool, setup_phases: dict | None = None) -> ProgressLogger:
    """Made after the checkpoint is loaded (its clock starts now); rank 0 writes the metrics."""
    train, is_main, world = run.config.train, dist.get_rank() == 0, dist.get_world_size()
    peak = peak_flops_per_s(train, run.device)
    settings = ProgressSettings(train.steps, train.log_every, run.tokens_per_step,
                                flops_per_token=run.size.flops_per_token,
                                peak_flops=None if peak is None else peak * world,
                                out_dir=train.out_dir if is_main else "",
                                log=run.config.log if is_main else None, run_config=run.config.to_dict(),
                                first_step=run.start_step, append=resumed, setup_phases=setup_phases)
    logger = ProgressLogger(settings, run.device, run.say)
    logger.extras = lambda: _line_extras(run)
    logger.rank = dist.get_rank()
    return logger


def _line_extras(run: RunState) -> dict:
    """What a step line records besides its numbers: compilations since the last line, rank 0's CUDA
    allocator retries since the last line, and whether an asynchronous checkpoint was still being
    written (each explains a slow interval)."""
    extras = {}
    compiled = run.compile_watch.take()
    if compiled:
        extras["compiled"] = compiled
    retries = alloc_retries(run.device)
    if retries > run.alloc_retries_seen:
        extras["alloc_retries"] = retries - run.alloc_retries_seen
        run.alloc_retries_seen = retries
    if run.beside_save:
        extras["saving"] = True
        run.beside_save = False
    return extras
