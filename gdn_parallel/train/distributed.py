"""Multi-process training under torchrun: every parallel dimension from `config.parallel`.

    torchrun --nproc_per_node=4 -m gdn_parallel.train --set parallel.tp=2 --set parallel.cp=2

Each data-parallel replica reads its own slice of the documents; a step is `train.batch_size /
train.microbatch_size` packed rows of `train.microbatch_size` sequences per replica (the pipeline's
micro-batches under pipeline parallelism). The loss printed is the
global mean over all replicas (rank 0 prints). Evaluation runs in single-process mode only.
"""
from __future__ import annotations

import math
import os
import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..data.corpus import load_corpus
from ..data.packing import packed_batches
from ..ops.triton_dispatch import check_kernel_config
from .loop import param_groups
from .progress import ProgressLogger, format_duration, peak_flops_per_s
from .schedule import schedule_from_config


def is_distributed_launch() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def run_distributed_training(config: Config, print_fn=None) -> dict:
    from ..model import HybridLM
    from ..parallel.mesh import build_mesh
    from ..parallel.parallelize import parallelize

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        config.validate(world_size=dist.get_world_size())
        train, pc = config.train, config.parallel
        if train.dtype == "float16":
            raise ConfigError("train.dtype=float16 needs a gradient scaler, which sharded training does not "
                              "use here; use bfloat16 or float32")
        check_kernel_config(config.model, cuda, train.dtype)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        is_main = dist.get_rank() == 0
        say = (print_fn or (lambda line: print(line, flush=True))) if is_main else (lambda line: None)
        dims = build_mesh(pc, device.type)
        torch.manual_seed(train.seed)             # identical initial weights on every rank
        model = HybridLM(config.model).to(device)
        flops_per_token = float(model.flops_per_token(train.seq_len))  # before tensor parallel slicing
        num_parameters = model.num_parameters()
        parallel = parallelize(model, dims, pc, device=device, seq_len=train.seq_len,
                               activation_checkpointing=train.activation_checkpointing)
        optimizer = torch.optim.AdamW(param_groups(parallel.parameters(), train.weight_decay),
                                      lr=train.lr, betas=(train.beta1, train.beta2), fused=cuda)
        schedule = schedule_from_config(train)
        autocast_dtype = getattr(torch, train.dtype) if cuda and train.dtype != "float32" else None

        corpus = load_corpus(config.data)
        dp_rank = dims.rank("dp")
        documents = corpus.train[dp_rank::pc.dp]  # disjoint documents per data-parallel replica
        batches = packed_batches(documents, train.seq_len, train.microbatch_rows, seed=config.data.seed)
        tokens_per_step = train.batch_size * train.seq_len * pc.dp
        say(f"data  | {corpus.describe()} | {len(documents):,} docs on dp replica 0")
        say(f"model | {num_parameters:,} parameters | layers {config.model.layer_types}")
        say(f"mesh  | pp {pc.pp} x dp {pc.dp} x cp {pc.cp} x tp {pc.tp} ({pc.data_parallel}, "
            f"cp {pc.cp_algorithm}, sp {pc.sequence_parallel}, {train.microbatches} micro-batches) on {device.type}")
        logger = ProgressLogger(train.steps, train.log_every, tokens_per_step, device,
                                flops_per_token=flops_per_token,
                                peak_flops=_cluster_peak(train, device, dist.get_world_size()),
                                out_dir=train.out_dir if is_main else "", print_fn=say)
        clip = train.grad_clip if train.grad_clip > 0 else math.inf
        for step in range(train.steps):
            rows = [next(batches).to(device, non_blocking=True) for _ in range(train.microbatches)]
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            loss = parallel.train_step(rows, autocast_dtype=autocast_dtype)
            grad_norm = parallel.clip_grad_norm(clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            logger.step(step, loss, schedule(step), grad_norm)
        summary = {"first_loss": logger.losses[0], "final_loss": logger.records[-1]["loss"],
                   "steps": train.steps, "train_time_s": logger.train_time_s, "losses": list(logger.losses)}
        say(f"done  | {train.steps} steps in {format_duration(logger.train_time_s)} | loss "
            f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}")
        logger.close({k: v for k, v in summary.items() if k != "losses"})
        return summary
    finally:
        dist.destroy_process_group()


def _cluster_peak(train, device, world_size: int):
    peak = peak_flops_per_s(train, device)
    return None if peak is None else peak * world_size
