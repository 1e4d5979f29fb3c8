"""`gdn-convert reshard`: load a checkpoint under another layout and check that every tensor landed.

Run under a launcher with the layout's world size (torchrun --nproc_per_node=tp*pp*cp*dp ...). The
model is built and parallelised as the trainer does it, the checkpoint loaded with
gdn_parallel.checkpoint.load_checkpoint (DCP reshards it); then each rank compares every parameter
and AdamW slot it holds with the single-device tensor read from the checkpoint, cut to what that
rank should hold (its tensor-parallel piece along `_tp_shard_dim`, then its FSDP shard), bit for
bit, and the ranks together must hold every model tensor. Rank 0 writes a JSON report. With --out
the checkpoint is saved again from this layout (CheckpointSaver: <out>/checkpoints/step_<N>).
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..checkpoint import CheckpointSaver, load_checkpoint, read_trainer_state
from ..checkpoint.files import CONFIG_COPY, final_path, write_run_record
from ..checkpoint.manager import LAYOUT_DEGREES, layout_record
from ..checkpoint.state import MODEL, OPTIM
from ..config import Config, ConfigError, creation_problem, parse_override
from ..model import build_model, check_layers
from ..parallel.mesh import MESH_DIMS, build_mesh
from ..parallel.parallelize import parallelize
from ..parallel.pipeline import parts_of_rank
from ..parallel.tensor import tp_shard_dim
from ..runtime.session import is_launched, process_group
from .atomic import check_creatable
from .dcp_io import read_tensors, resolve_checkpoint, tensor_entries
from .errors import ConvertError
from .hf_tokenizer import carried_files

MISMATCH_EXIT = 1


def layout_config(saved_config: dict, layout: str) -> Config:
    """The saved config under `layout` ('tp=2,pp=2,cp=1,dp=1'; degrees not named are 1; any other
    parallel field may be given too, e.g. data_parallel=ddp)."""
    items = [item.strip() for item in layout.split(",") if item.strip()]
    if not items:
        raise ConvertError("--layout is empty; give the degrees, e.g. --layout tp=2,pp=2,cp=1,dp=1")
    overrides = [f"parallel.{name}=1" for name in LAYOUT_DEGREES]
    for item in items:
        parse_override(f"parallel.{item}")  # names the field when it is not a parallel one
        overrides.append(f"parallel.{item}")
    config = Config.from_dict(saved_config).with_overrides(overrides)
    named = {item.split("=", 1)[0].strip() for item in items}
    if config.parallel.tp == 1 and "sequence_parallel" not in named:
        config.parallel.sequence_parallel = False   # the saved run's, meaningless without tp
    config.model.validate()
    config.parallel.validate(config.model)
    check_layers(config.model, config.parallel.tp, config.parallel.cp)
    return config


def run_config(config: Config, saved_dp: int, overrides: list[str]) -> tuple[Config, list[str]]:
    """The config `--out` writes: the run under the new layout, with the same global batch (train.batch_size
    is per data-parallel replica, so it is rescaled when dp changes) and `overrides` of non-model fields;
    refused, naming the fix, when it would not train as written. Returns it and what was changed."""
    train, notes = config.train, []
    rows = train.batch_size * saved_dp
    batch_given = any(o.strip().startswith("train.batch_size=") for o in overrides)
    if config.parallel.dp != saved_dp and not batch_given:
        if rows % config.parallel.dp:
            raise ConvertError(f"the run's global batch of {rows} rows (train.batch_size="
                               f"{train.batch_size} x dp={saved_dp}) does not split over parallel.dp="
                               f"{config.parallel.dp} replicas; choose a dp that divides {rows}, or give "
                               f"--set train.batch_size=N (rows per replica)")
        notes.append(f"reshard | train.batch_size {train.batch_size} -> {rows // config.parallel.dp} rows "
                     f"per replica: the global batch stays {rows} rows")
        config = config.with_overrides([f"train.batch_size={rows // config.parallel.dp}"])
    for item in overrides:
        if parse_override(item)[0] not in ("train", "checkpoint", "log"):
            raise ConvertError(f"--set {item}: reshard --out sets train, checkpoint and log fields only (the "
                               f"model and data are the checkpoint's, the layout is --layout)")
    config = config.with_overrides(list(overrides))
    try:
        config.train.validate()
        config.parallel.validate(config.model, config.train)
        check_layers(config.model, config.parallel.tp, config.parallel.cp, config.train.recompute_chunks)
    except ConfigError as err:
        raise ConvertError(f"the config.yaml --out would write does not train under this layout: {err} (give "
                           f"it with --set, e.g. --set train.microbatch_size=1)") from None
    return config, notes


def reshard(checkpoint, layout: str, out_dir: str | None = None, report: str = "reshard_report.json",
            print_fn=print, overrides: Sequence[str] = ()) -> int:
    _check_output_paths(out_dir, report)
    source = resolve_checkpoint(checkpoint)
    saved = read_trainer_state(source)
    config = layout_config(saved.get("config", {}), layout)
    if overrides and not out_dir:
        raise ConvertError("--set changes the config --out writes: give --out DIR too")
    notes: list[str] = []
    if out_dir:
        config, notes = run_config(config, int(saved.get("layout", {}).get("dp", 1)), list(overrides))
    world = config.parallel.world_size
    if world > 1 and not dist.is_initialized() and not is_launched():
        raise ConvertError(f"--layout {layout} needs {world} processes: run under torchrun "
                           f"--nproc_per_node={world} -m gdn_parallel.convert reshard ...")
    if out_dir:
        _check_out(out_dir, source, int(saved.get("step", 0)))
    with process_group(config.train) as (device, _launched):
        if dist.get_world_size() != world:
            raise ConfigError(f"--layout {layout} needs {world} processes, the job has "
                              f"{dist.get_world_size()}; launch with torchrun --nproc_per_node={world}")
        if dist.get_rank() == 0:
            for note in notes:
                print_fn(note)
        return _reshard(source, saved, config, device, out_dir, report, print_fn)


def _check_output_paths(out_dir: str | None, report: str) -> None:
    """Before the checkpoint is read: the report file (rewritten when it exists) and --out (a run
    directory, new or existing) can be written."""
    if Path(report).is_dir():
        raise ConvertError(f"--report {report} is a directory; give a file path (e.g. "
                           f"{Path(report) / 'reshard_report.json'})")
    check_creatable(report, "--report")
    if not out_dir:
        return
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConvertError(f"--out {out_dir} is a file; give a directory (the run to save into)")
    problem = creation_problem(Path(out_dir) / CONFIG_COPY)   # probes out_dir, or where it will be made
    if problem is not None:
        raise ConvertError(f"--out {out_dir} cannot be written: {problem}; choose a directory you can "
                           f"write")


def _check_out(out_dir: str, source: Path, step: int) -> None:
    if Path(out_dir).resolve() == source.resolve().parent.parent:
        raise ConvertError(f"--out {out_dir} is the run that holds {source}: saving would replace the "
                           f"checkpoint being checked; choose another --out")
    if final_path(out_dir, step).exists():
        raise ConvertError(f"--out {out_dir} already holds {final_path(out_dir, step)}; remove it or choose "
                           f"another --out (nothing is overwritten)")


def _reshard(source: Path, saved: dict, config: Config, device, out_dir, report, print_fn) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    pc = config.parallel
    dims = build_mesh(pc, device.type, timedelta(seconds=config.train.collective_timeout_s))
    parts = parts_of_rank(config.model, pc, dims.rank("pp"), config.train.seq_len)
    model = build_model(config.model, device, config.train.seed, keep=parts.__contains__)
    parallel = parallelize(model, dims, pc, device=device, seq_len=config.train.seq_len)
    named = parallel.named_parameters()
    entries = tensor_entries(source)
    has_optimizer = any(key.startswith(OPTIM) for key in entries)
    optimizer = torch.optim.AdamW(parallel.parameters()) if has_optimizer else None
    load_checkpoint(source, named, optimizer, dims, config, same_layout=lambda _saved: False)

    held = _held_tensors(named, optimizer)
    absent = sorted(key for key in held if key not in entries)
    expected = read_tensors(source, entries, [key for key in held if key in entries])
    mismatches = [f"{key}: not in the checkpoint" for key in absent]
    mismatches += [problem for key, (value, param) in held.items() if key in expected
                   for problem in _compare(key, value, param, expected[key], dims)]

    mesh_coordinates = {name: dims.rank(name) for name in MESH_DIMS}
    mine = {"rank": rank, "mesh": mesh_coordinates, "tensors": len(held), "mismatches": mismatches,
            "names": [name for name, _ in named]}
    everyone: list[dict] = [None] * world
    dist.all_gather_object(everyone, mine)
    loaded = {MODEL + name for result in everyone for name in result.pop("names")}
    nowhere = sorted(key for key in entries if key.startswith(MODEL) and key not in loaded)
    ok = not nowhere and not any(result["mismatches"] for result in everyone)

    saved_to = None
    if ok and out_dir:
        saved_to = _save_again(out_dir, source, saved, config, named, optimizer, dims)
    if rank == 0:
        summary = {"ok": ok, "checkpoint": str(source), "step": saved.get("step"),
                   "layout": layout_record(config, world),
                   "tensors_checked": sum(r["tensors"] for r in everyone),
                   "model_tensors": sum(1 for key in entries if key.startswith(MODEL)),
                   "held_by_no_rank": nowhere, "saved_to": saved_to, "ranks": everyone}
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps(summary, indent=1) + "\n")
        verdict = "every tensor landed" if ok else "MISMATCH"
        print_fn(f"reshard | {source} under {_layout_text(config)} on {world} process(es): {verdict} "
                 f"({summary['tensors_checked']} tensors checked) | report {report}"
                 + (f" | saved {saved_to}" if saved_to else ""))
    return 0 if ok else MISMATCH_EXIT


def _layout_text(config: Config) -> str:
    return ",".join(f"{name}={getattr(config.parallel, name)}" for name in LAYOUT_DEGREES)


def _held_tensors(named, optimizer) -> dict[str, tuple]:
    """checkpoint key -> (this rank's tensor, its parameter), for every parameter and optimizer slot."""
    held = {}
    for name, param in named:
        held[MODEL + name] = (param, param)
        if optimizer is not None:
            for slot, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    held[f"{OPTIM}{name}.{slot}"] = (value, param)
    return held


def _expected_local(full: torch.Tensor, value: torch.Tensor, param, dims) -> torch.Tensor:
    """What this rank should hold of the single-device tensor `full`: its tensor-parallel piece
    (equal slices along `_tp_shard_dim`, model/tensor.py), then its FSDP shard of that piece."""
    dim, tp = tp_shard_dim(param), dims.config.tp
    piece = full if dim is None or tp == 1 or full.dim() == 0 else full.chunk(tp, dim)[dims.rank("tp")]
    if isinstance(value, DTensor):
        return distribute_tensor(piece.to(value.device), value.device_mesh, value.placements,
                                 src_data_rank=None).to_local()
    return piece


def _compare(key: str, value: torch.Tensor, param, full: torch.Tensor, dims) -> list[str]:
    expected = _expected_local(full, value, param, dims)
    actual = value.to_local() if isinstance(value, DTensor) else value
    if actual.shape != expected.shape:
        return [f"{key}: local shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"]
    expected = expected.to(device=actual.device, dtype=actual.dtype)
    if not torch.equal(actual.detach(), expected):
        differing = int((actual.detach() != expected).sum())
        return [f"{key}: {differing} of {actual.numel()} values differ from the checkpoint"]
    return []


def _save_again(out_dir: str, source: Path, saved: dict, config: Config, named, optimizer, dims) -> str:
    """The checkpoint again, written from this layout as the trainer writes one: a run directory
    `out_dir` (its config.yaml: the config under this layout, with out_dir its own) holding
    checkpoints/step_<N>, whose trainer_state.json records this layout and the saved data position."""
    step = int(saved.get("step", 0))
    config = Config.from_dict(config.to_dict())
    config.train.out_dir = str(out_dir)
    # The same run under another layout: its run id goes along, in the checkpoint and as the run id
    # of out_dir, so that resuming there continues that run (checkpoint/loading.py run_identity).
    run_id = saved.get("run_id")
    if dist.get_rank() == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / CONFIG_COPY).write_text(config.to_yaml(), encoding="utf-8")
        if isinstance(run_id, str) and run_id:
            write_run_record(out_dir, {"run_id": run_id, "resharded_from": str(source),
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    saver = CheckpointSaver(out_dir, attachments=carried_files(source))   # the tokenizer goes along
    identity = {"run_id": run_id} if isinstance(run_id, str) and run_id else {}
    saver.save(step, named, optimizer, dims, config, saved.get("data", {}).get("stream", {}),
               resharded_from=str(source), **identity)
    return str(final_path(out_dir, step))
