"""Command line: `gdn-verify` (also `python -m gdn_parallel.verify`), under any launcher.

    torchrun --standalone --nproc-per-node 4 -m gdn_parallel.verify --config configs/tiny-cpu.yaml
    gdn-verify [--config PATH] [--set section.field=value ...] [--layouts tp2,cp2 [pp=2,dp=2,ddp ...]]
               [--steps 1] [--dtype fp32|bf16] [--seq-len N] [--rows 2] [--tolerance X] [--json PATH] [--list]
               [--checkpoint]

Every layout of the job's N processes (gdn_parallel/verify/layouts.py: the default set, or
`--layouts`) trains `--steps` AdamW steps on a fixed batch (verify/batches.py: N micro-batches of
rows x seq-len tokens whose documents cross the CP shard and row boundaries) from the weights of one
seed, and is compared with the single-device reference every rank computes itself: the loss, the
gradient norm, every gradient gathered to full shape, and the parameters after each step
(criteria: verify/compare.py). Rank 0 prints a table and writes the JSON (`--json`, default
runs/verify.json or $OUT/verify.json). Exit status: 0 every layout passed, 1 a layout failed, 2 the
command or config is wrong (the message says what to change).

`--checkpoint` (2 steps unless --steps says more) also saves each layout's checkpoint after step 1,
after an evaluation, and resumes step 2 from it into the same layout (bit for bit) and into the
reference (under the criteria), and compares the evaluation with the reference's (checkpoint_leg.py).
The checkpoints go to a temporary directory beside the JSON file, which every rank must see; it is
removed at the end.

`--inject-fault LAYOUT[:grads|:params|:ckpt|:unsharded]` (hidden, repeatable) is for the tests only:
in that layout it multiplies one gradient of the last rank by 1.5 after the backward (grads, the
default), or one of its parameters after the optimizer step (params), or (with --checkpoint) one
AdamW moment of the last rank after the same-layout load (ckpt), or unshards the FSDP2 root modules
after the evaluation, as evaluations once left them (unsharded), to show that a wrong layout or
checkpoint fails the run.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import math
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..config import Config, ConfigError, creation_problem
from ..model import check_kernels
from ..runtime import detect_launch_env, process_group, strip_launcher_args
from ..runtime.compile_workers import stop_compile_workers_and_say
from ..runtime.launch_env import say_on_first_process
from .batches import MIN_ROW_TOKENS, verification_batch
from .checkpoint_leg import CHECKPOINT_FAULTS, SAVED_AFTER, CheckpointSettings, shared_directory
from .layout_run import FAULT_KINDS
from .layouts import Layout, LayoutError, layouts_to_run, parse_layout
from .reference import OptimizerSettings
from .report import default_json_path, table, to_json, write_json
from .runner import verify

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gdn-verify",
        description="Check every parallel layout of this job's processes against one device.")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"YAML config whose model is checked (default {DEFAULT_CONFIG}; relative to the "
                             "current directory, else the repository, else the configs installed with the "
                             "package)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE",
                        help="override a config field, e.g. --set model.n_layers=8 (repeatable)")
    parser.add_argument("--layouts", nargs="+", action="extend", metavar="LAYOUT",
                        help="layouts to check instead of the default set, each like tp2,cp2 or "
                             "pp=2,dp=2,ddp (options: sp, allgather, zigzag, ddp, interleaved, vs=N, "
                             "ac=full|selective); the word default adds the default set, e.g. "
                             "--layouts default cp2,zigzag")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps compared (default 1; 2 with --checkpoint)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(PRECISIONS),
                        help="fp32 (default): every error within 1e-5 (CPU) / 1e-4 (CUDA); bf16: autocast "
                             "against the fp32 reference, no worse than 1.5x bf16 on one device, loss within "
                             "1e-2")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per row (default: the config's train.seq_len)")
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch (default 2)")
    parser.add_argument("--seed", type=int, default=None, help="weights and data seed (default: train.seed)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="replace the bound (fp32) or its floor (bf16)")
    parser.add_argument("--json", default=None,
                        help="results file (default $OUT/verify.json when $OUT is set, else "
                             "runs/verify.json)")
    parser.add_argument("--list", action="store_true", help="print the layouts that would run, and exit")
    parser.add_argument("--checkpoint", action="store_true",
                        help="also save each layout's checkpoint after step 1 (after an evaluation) and "
                             "resume step 2 from it into the same layout (must be bit-exact) and into the "
                             "one-device reference; compares the evaluation with the reference's")
    # tests only (the module's docstring)
    parser.add_argument("--inject-fault", action="append", default=[], help=argparse.SUPPRESS)
    return parser


def resolve_config_path(path: str) -> Path:
    """As given, else relative to the repository, else `configs/NAME` among the installed configs
    (the trainer's rule: gdn_parallel/train/__main__.py)."""
    candidate = Path(path).expanduser()
    if candidate.is_file() or candidate.is_absolute():
        return candidate
    if (REPO_ROOT / candidate).is_file():
        return REPO_ROOT / candidate
    if candidate.parent == Path("configs"):
        packaged = resources.files("gdn_parallel") / "configs" / candidate.name
        if packaged.is_file():
            return Path(str(packaged))
    return candidate


@dataclass(frozen=True)
class VerifyRequest:
    """What the command line asks for, checked before any process group exists."""
    args: argparse.Namespace
    config: Config
    world: int             # processes of the job (every layout uses them all)
    seq_len: int
    steps: int             # optimizer steps compared
    layouts: list[tuple[Layout, str | None]]   # (layout, why it is skipped or None)
    faults: dict[str, str]                     # --inject-fault: layout name -> kind

    @property
    def precision(self) -> str:
        return PRECISIONS[self.args.dtype]

    @property
    def seed(self) -> int:
        return self.config.train.seed if self.args.seed is None else self.args.seed


def main(argv: list[str] | None = None) -> int:
    from ..runtime.session import watch_for_stalls
    watch_for_stalls()
    try:
        return _verify(argv)
    finally:   # the end bounded: torch's own stop at exit may wait minutes (runtime/compile_workers.py)
        stop_compile_workers_and_say(say_on_first_process)


def _verify(argv: list[str] | None) -> int:
    if not faulthandler.is_enabled():  # a rank killed by a signal prints its Python stacks
        faulthandler.enable(all_threads=True)
    args = build_parser().parse_args(strip_launcher_args(sys.argv[1:] if argv is None else argv))
    launch = detect_launch_env()
    is_main = launch is None or launch.rank == 0
    say = (lambda line: print(line, flush=True)) if is_main else (lambda line: None)
    try:
        request = _request(args, launch.world_size if launch is not None else 1)
    except (ConfigError, LayoutError) as err:
        return _refused(err, is_main)
    if args.list:
        for layout, reason in request.layouts:
            say(layout.name + (f"  (skipped: {reason})" if reason else ""))
        return 0
    if torch.cuda.is_available():
        _fp32_reference_on_cuda()
    with process_group(request.config.train) as (device, _launched):
        try:
            check_kernels(request.config.model, device.type == "cuda")
        except ConfigError as err:
            return _refused(err, is_main)
        steps = [verification_batch(step, request.world, args.rows, request.seq_len,
                                    request.config.model.vocab_size, device)
                 for step in range(request.steps)]
        say(_headline(request, device))
        with contextlib.ExitStack() as stack:
            try:
                checkpoint = _checkpoint_settings(request, stack)
            except ConfigError as err:
                return _refused(err, is_main)
            result = verify(request.config.model, request.seed, steps, request.layouts, device,
                            OptimizerSettings.from_train_config(request.config.train), request.seq_len,
                            request.precision, args.tolerance, request.faults, progress=say,
                            checkpoint=checkpoint,
                            after_layout=lambda so_far: _write_so_far(request, so_far, device, is_main))
        if is_main:
            _report(request, result, device, say)
    return 0 if result.passed else 1


def _request(args: argparse.Namespace, world: int) -> VerifyRequest:
    """The config, batch shape, step count, layouts and faults asked for (ConfigError, LayoutError: the
    command or config is wrong)."""
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len {args.seq_len} must be positive (leave it out for the config's "
                          f"train.seq_len)")
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance > 0):
        raise ConfigError(f"--tolerance {args.tolerance} must be a positive number (a relative error bound, "
                          f"e.g. 1e-5)")
    if not args.list:   # --list writes nothing
        _check_json_path(args.json)
    config = Config.from_yaml(resolve_config_path(args.config), args.overrides)
    seq_len = args.seq_len or config.train.seq_len
    steps = args.steps if args.steps is not None else (SAVED_AFTER + 1 if args.checkpoint else 1)
    if steps < 1 or args.rows < 1 or args.rows * seq_len < MIN_ROW_TOKENS:
        raise ConfigError(f"--steps {steps} must be positive and --rows {args.rows} x --seq-len {seq_len} "
                          f"at least {MIN_ROW_TOKENS} tokens")
    if args.checkpoint and steps <= SAVED_AFTER:
        raise ConfigError(f"--checkpoint saves after step {SAVED_AFTER} and resumes step {SAVED_AFTER + 1}: "
                          f"give --steps {SAVED_AFTER + 1} or more, or leave --steps out")
    layouts = layouts_to_run(args.layouts, world, config.model, args.rows * seq_len)
    faults = _faults(args.inject_fault, [l for l, reason in layouts if reason is None], args.checkpoint)
    return VerifyRequest(args, config, world, seq_len, steps, layouts, faults)


def _check_json_path(given: str | None) -> None:
    """The results file must be writable before any work: it is written after each layout and at the end
    (a file that exists is replaced)."""
    path = Path(given or default_json_path())
    flag = f"--json {given}" if given else f"the results file {path} (--json's default)"
    if path.is_dir():
        raise ConfigError(f"{flag} is a directory; give a file path, e.g. --json {path / 'verify.json'}")
    problem = creation_problem(path)
    if problem is not None:
        raise ConfigError(f"{flag} cannot be written: {problem}; give --json PATH in a directory you can "
                          f"write")


def _refused(err: Exception, is_main: bool) -> int:
    """Exit status 2: the command or config is wrong, and the message says what to change."""
    if is_main:
        print(f"gdn-verify: {err}", file=sys.stderr)
    return 2


def _fp32_reference_on_cuda() -> None:
    # The reference is fp32 (and so is an fp32 layout): no TF32 in cuBLAS or cuDNN, and fp32-accurate
    # 3xTF32 in the Triton kernels' dots (IEEE dots compile for minutes on Hopper: tests/conftest.py).
    os.environ.setdefault("TRITON_F32_DEFAULT", "tf32x3")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _headline(request: VerifyRequest, device: torch.device) -> str:
    args = request.args
    return (f"gdn-verify | {request.world} {device.type} process(es) | {args.config} | {request.precision} "
            f"| {request.steps} step(s) x {request.world} micro-batches of {args.rows} x {request.seq_len} "
            f"tokens | {len(request.layouts)} layouts"
            + (f" | checkpoint after step {SAVED_AFTER}, resumed" if args.checkpoint else ""))


def _checkpoint_settings(request: VerifyRequest, stack: contextlib.ExitStack) -> CheckpointSettings | None:
    """--checkpoint's leg: a temporary directory beside the JSON file, which every rank must see,
    removed when `stack` closes (ConfigError: no such directory is shared)."""
    if not request.args.checkpoint:
        return None
    root = stack.enter_context(shared_directory(Path(request.args.json or default_json_path()).parent))
    return CheckpointSettings(root, request.config)


def _report(request: VerifyRequest, result, device: torch.device, say) -> None:
    """The criteria, the column legend, the table and the JSON file (rank 0)."""
    args = request.args
    say(f"criteria | {result.criteria.describe()}")
    say("columns  | relative errors, worst over the steps: loss, gradient norm, gradients (worst tensor, "
        "all as one vector), parameters after the step vs AdamW on one device with the layout's gradients")
    if args.checkpoint:
        resumed = SAVED_AFTER + 1
        say(f"checkpoint | saved after step {SAVED_AFTER}, after an evaluation of step {resumed}'s rows; "
            f"val loss: that evaluation vs the reference's; resume ref: the reference resumed from the "
            f"checkpoint, worst relative error of step {resumed}; resume same: the layout resumed, bit for "
            f"bit")
    for line in table(result):
        say(line)
    say(f"json | {write_json(to_json(result, _json_header(request, result, device)), args.json)}")


def _write_so_far(request: VerifyRequest, result, device: torch.device, is_main: bool) -> None:
    """The JSON after each layout (rank 0): a run stopped part-way keeps the layouts it finished."""
    if is_main:
        write_json(to_json(result, _json_header(request, result, device)), request.args.json)


def _json_header(request: VerifyRequest, result, device: torch.device) -> dict:
    args = request.args
    header = {"world": request.world, "device": _device_name(device), "config": str(args.config),
              "overrides": args.overrides, "steps": request.steps, "micro_batches": request.world,
              "rows": args.rows, "seq_len": request.seq_len, "seed": request.seed}
    if args.checkpoint:
        header["checkpoint"] = {"saved_after_step": SAVED_AFTER, "val_loss_bound": result.val_loss_bound}
    return header


def _faults(specs: list[str], runnable: list[Layout], checkpoint: bool) -> dict[str, str]:
    """--inject-fault LAYOUT[:KIND] ... -> {layout name: kind}, checked against the layouts that run."""
    names = [l.name for l in runnable]
    faults = {}
    for spec in specs:
        name, _, kind = spec.partition(":")
        kind = kind or "grads"
        if kind not in FAULT_KINDS + CHECKPOINT_FAULTS:
            raise LayoutError(f"--inject-fault {spec}: the kind after ':' is one of "
                              f"{', '.join(FAULT_KINDS + CHECKPOINT_FAULTS)}")
        if kind in CHECKPOINT_FAULTS and not checkpoint:
            raise LayoutError(f"--inject-fault {spec}: {kind} spoils the checkpoint leg; add --checkpoint")
        layout = parse_layout(name)
        if layout.name not in names:
            raise LayoutError(f"--inject-fault {spec}: {layout.name} is not a layout this run checks "
                              f"({', '.join(names)})")
        if kind == "unsharded" and not (layout.data_parallel == "fsdp" and layout.dp * layout.cp > 1):
            raise LayoutError(f"--inject-fault {spec}: unsharded needs an FSDP2 layout (dp or cp above 1, "
                              f"not ddp)")
        faults[layout.name] = kind
    return faults


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
