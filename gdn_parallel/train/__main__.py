"""Command line: `python -m gdn_parallel.train` (console script `gdn-train`).

    gdn-train [--config PATH] [--set section.field=value ...] [--steps N]

--config defaults to configs/tiny-cpu.yaml, looked up relative to the current directory and then to
the repository this package lives in. --set overrides any config field (values parsed as YAML).
--steps N is short for --set train.steps=N; when the config's warmup is longer than N steps and no
--set gives train.warmup_steps, the warmup is shortened to N // 10.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from ..config import Config, ConfigError

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_config_path(path: str) -> Path:
    candidate = Path(path).expanduser()
    if candidate.is_file() or candidate.is_absolute():
        return candidate
    fallback = REPO_ROOT / candidate
    return fallback if fallback.is_file() else candidate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdn-train", description="Train a GDN / SWA hybrid LM.")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"YAML config (default {DEFAULT_CONFIG}, relative to the current directory, "
                             f"else to the repository root)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field, e.g. --set train.lr=1e-3 (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="shortcut for --set train.steps=N")
    return parser


def load_config(args) -> Config:
    path = resolve_config_path(args.config)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
        warmup_given = any(o.split("=", 1)[0].strip() == "train.warmup_steps" for o in args.overrides)
        if not warmup_given and args.steps > 0:
            base = Config.from_yaml(path, list(args.overrides))
            if base.train.warmup_steps > args.steps:
                overrides.append(f"train.warmup_steps={args.steps // 10}")
    return Config.from_yaml(path, overrides)


def run(argv: Optional[List[str]] = None) -> dict:
    """Parse the command line, train, and return run_training's summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args)
    except ConfigError as err:
        parser.error(str(err))
    from .distributed import is_distributed_launch, run_distributed_training
    from .loop import run_training
    try:
        if is_distributed_launch():
            return run_distributed_training(config)
        if config.parallel.world_size > 1:
            raise ConfigError(f"parallel.tp * pp * cp * dp = {config.parallel.world_size} needs that many "
                              f"processes: launch with torchrun --nproc_per_node={config.parallel.world_size}")
        return run_training(config)
    except ConfigError as err:
        parser.error(str(err))


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry point: 0 on success; configuration errors exit with status 2 and the message."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
