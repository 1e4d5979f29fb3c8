"""Command line: `python -m gdn_parallel.train` (console script `gdn-train`).

    gdn-train [--config PATH] [--set section.field=value ...] [--steps N] [--print-config]
    gdn-train --help-config [SECTION]

--config defaults to configs/tiny-cpu.yaml, looked up relative to the current directory, then to
the repository this package lives in, then (configs/NAME) among the configs installed with it.
--set overrides any config field (values parsed as YAML).
--steps N is short for --set train.steps=N (and wins over it when both are given).
--print-config prints the resolved config (after all of these) as YAML, each field with its help, and
exits 0 without training; the output is a config file (`--config` reads it back).
--help-config [SECTION] lists every field (of SECTION) with its default, help and range or choices,
and exits 0; --help names the sections. Both read each field's declaration in gdn_parallel/config.py,
as the validation errors do.

Steps and warmup, one rule for `--steps N` and `--set train.steps=N`: when the command line sets
train.steps but not train.warmup_steps and the config's warmup does not fit the new step count (longer,
or under the cosine schedule as long: it needs one update to decay in), the warmup is shortened to
steps // 10 and the run's first line (`note  | ...`, on stdout; stderr under --print-config) says so. A
warmup that does not fit the steps the user chose together (both on the command line, or both in the
YAML file) is an error naming both fields.

Exit status (each process's; under torchrun, torchrun itself exits 1 when a worker fails and lists
the workers' statuses), after one line on stderr that says what happened and what to do:

    0  trained (also after SIGTERM/SIGINT: the step in flight finished and a checkpoint was saved)
    2  refused input: a bad config value, unknown field or malformed YAML file (naming `section.field`
       or the file and line), data too small for one step, an out_dir holding another run, a
       checkpoint that fails verification, cannot be read safely, holds another model or values that
       are not finite, a resume that changes the LR schedule without train.schedule_override=true
       (train/schedule.py)
    3  the loss or gradient was not finite train.max_skipped_steps steps in a row, or at the first step
       after a resume; or the parameters or optimizer moments were not finite at a save (none is
       written from them): the run stopped
    4  a file could not be written (a full disk, no permission): the partial checkpoint was removed,
       the earlier ones are intact
    5  another rank ended or stopped answering (killed, crashed, out of memory, stuck past
       train.collective_timeout_s), or the process group could not be formed: each rank that saw it
       says so; the checkpoints written are intact and `--resume auto` continues (torchrun
       --max-restarts=N restarts by itself)
Anything else is a defect: a traceback, and status 1.
"""
from __future__ import annotations

import argparse
import errno
import faulthandler
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import NoReturn

from ..config import Config, ConfigError, parse_override
from ..runtime.compile_workers import stop_compile_workers_and_say
from .commented_config import commented_yaml, fields_table, section_names, sections_overview

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = "configs"  # at the repository root; installed as gdn_parallel/configs (setup.py)


def resolve_config_path(path: str) -> Path:
    """Find a --config file: as given (relative to the current directory), else relative to the
    repository root (source checkout, editable install), else, for `configs/NAME`, the copy of NAME
    installed with the package (`pip install .`). A path found nowhere is returned as given, so the
    error names what the user typed."""
    candidate = Path(path).expanduser()
    if candidate.is_file() or candidate.is_absolute():
        return candidate
    in_repo = REPO_ROOT / candidate
    if in_repo.is_file():
        return in_repo
    if candidate.parent == Path(CONFIGS_DIR):  # `other/tiny-cpu.yaml` must not become the packaged file
        packaged = resources.files("gdn_parallel") / CONFIGS_DIR / candidate.name
        if packaged.is_file():
            return Path(str(packaged))  # a real file: wheels install unzipped
    return candidate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gdn-train", description="Train a GDN / SWA hybrid LM.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's columns
        epilog="config sections (--set SECTION.FIELD=VALUE; --help-config SECTION lists their fields\n"
               f"with the defaults, help and ranges or choices):\n{sections_overview()}")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"YAML config (default {DEFAULT_CONFIG}, relative to the current directory, "
                             f"else to the repository root, else the configs installed with the package)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field, e.g. --set train.lr=1e-3 (repeatable)")
    parser.add_argument("--steps", type=int, default=None,
                        help="shortcut for --set train.steps=N (a longer warmup from the config is "
                             "shortened to N // 10)")
    parser.add_argument("--resume", default=None, metavar="auto|PATH",
                        help="continue a run: 'auto' takes the newest complete checkpoint under "
                             "<train.out_dir>/checkpoints (starting afresh when there is none), PATH a given "
                             "checkpoint directory; metrics.jsonl is appended to")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML, each field with its help, and exit")
    parser.add_argument("--help-config", nargs="?", const="all", default=None, metavar="SECTION",
                        choices=[*section_names(), "all"],
                        help="list every config field (of SECTION) with its default, help and range or "
                             "choices, and exit")
    return parser


def load_config(args, say: Callable[[str], None] | None = None) -> Config:
    """The validated config of a parsed command line (steps and warmup: see the module docstring).
    `say` is told what was adjusted (default: printed on stdout by the first process)."""
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")  # last: --steps wins over --set train.steps
    config = Config.from_yaml(resolve_config_path(args.config), overrides, validate=False)
    set_on_command_line = {".".join(parse_override(item)[:2]) for item in overrides}
    train = config.train
    if ("train.steps" in set_on_command_line and "train.warmup_steps" not in set_on_command_line
            and 0 < train.steps and train.warmup_steps > train.longest_warmup):
        shortened = train.steps // 10
        (say or _say_first_process)(
            f"note  | train.warmup_steps={train.warmup_steps} of the config does not fit train.steps="
            f"{train.steps} set on the command line: the warmup is shortened to {shortened} update(s) "
            f"(steps // 10); to choose it, give --set train.warmup_steps=N (at most {train.longest_warmup})")
        train.warmup_steps = shortened
    return config.validate()


def _say_first_process(line: str) -> None:
    from ..runtime.launch_env import say_on_first_process  # torch only once a job runs
    say_on_first_process(line)


def _is_first_process() -> bool:
    from ..runtime.launch_env import is_first_process
    return is_first_process()


REFUSED, DIVERGED, WRITE_FAILED, PEER_LOST = 2, 3, 4, 5
# Errors of a file system, not of the program: reported in one line with WRITE_FAILED.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                          errno.EIO})


def run(argv: list[str] | None = None) -> dict:
    """Parse the command line, train (one process or any launcher), and return run_training's summary.
    An expected failure ends the process with one line on stderr and its exit status (module docstring)."""
    from ..checkpoint import CheckpointError, CheckpointWriteError
    from ..runtime.launch_env import strip_launcher_args
    parser = build_parser()
    # DeepSpeed's launcher adds --local_rank=N (its environment carries the same): not ours to parse.
    args = parser.parse_args(strip_launcher_args(sys.argv[1:] if argv is None else argv))
    if args.help_config is not None:  # the declared defaults: no config file is read
        sys.stdout.write(fields_table(None if args.help_config == "all" else args.help_config))
        raise SystemExit(0)
    notes: list[str] = []
    try:
        config = load_config(args, notes.append)
    except ConfigError as err:
        parser.error(str(err))
    if args.print_config:  # stdout is a config file: the notes go to stderr
        for note in notes:
            print(note, file=sys.stderr)
        command = " ".join(["gdn-train", *(sys.argv[1:] if argv is None else argv)])
        sys.stdout.write(commented_yaml(config, f"the resolved config of: {command}"))
        raise SystemExit(0)
    for note in notes:   # the run's first lines
        _say_first_process(note)
    from ..runtime.launch_env import GroupJoinError
    from ..runtime.session import PeerLost, is_launched
    from .trainer import TrainingDiverged, run_training
    try:
        if not is_launched() and config.parallel.world_size > 1:
            raise ConfigError(f"parallel.tp * pp * cp * dp = {config.parallel.world_size} needs that many "
                              f"processes: launch with torchrun "
                              f"--nproc_per_node={config.parallel.world_size} (or launch/deepspeed.sh, "
                              f"slurm.sbatch, mpirun.sh)")
        return run_training(config, resume=args.resume)
    except (ConfigError, CheckpointError) as err:
        _fail(parser, REFUSED, str(err))
    except TrainingDiverged as err:
        _fail(parser, DIVERGED, f"stopped: {err}")
    except CheckpointWriteError as err:
        _fail(parser, WRITE_FAILED, str(err))
    # Every rank that saw it speaks: the one that would speak may be the dead one.
    except (PeerLost, GroupJoinError) as err:
        _fail(parser, PEER_LOST, " ".join(str(err).split()), every_rank=True)
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        _fail(parser, WRITE_FAILED, f"cannot write {err.filename or 'a file'}: {err.strerror or err}")


def _fail(parser: argparse.ArgumentParser, status: int, message: str, every_rank: bool = False) -> NoReturn:
    """One line on stderr and `status`; from the first process only (every rank meets the same error)
    unless every_rank."""
    if every_rank or _is_first_process():
        print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: 0 on success; an expected failure exits with its status (module docstring)."""
    if not faulthandler.is_enabled():  # a rank killed by a signal (a native crash) prints its Python stacks
        faulthandler.enable(all_threads=True)
    from ..runtime.session import watch_for_stalls
    watch_for_stalls()
    try:
        run(argv)
    finally:   # the job's end bounded: torch's own stop at exit may wait minutes (runtime/compile_workers.py)
        stop_compile_workers_and_say(_say_first_process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
