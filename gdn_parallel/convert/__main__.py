"""Command line: `gdn-convert` (also `python -m gdn_parallel.convert`).

    gdn-convert to-hf CHECKPOINT OUT_DIR [--dtype keep|bf16|fp16|fp32] [--shard-size 5GB]
    gdn-convert from-hf HF_DIR OUT_CHECKPOINT [--config FILE] [--set S.F=V ...] [--dtype ...]
    gdn-convert to-torch CHECKPOINT FILE [--dtype ...]
    gdn-convert from-torch FILE OUT_CHECKPOINT [--config FILE] [--set S.F=V ...] [--dtype ...]
        (FILE: to-torch's {'model', 'config'}, or a bare state dict whose model --config describes)
    torchrun --nproc_per_node=N -m gdn_parallel.convert reshard CHECKPOINT --layout tp=2,pp=2,cp=1,dp=1
        [--out DIR] [--report FILE]

CHECKPOINT is a checkpoint directory (<out_dir>/checkpoints/step_<N>) or a run's out_dir (its newest
complete checkpoint). A checkpoint made by from-hf / from-torch resumes with
`gdn-train --config OUT_CHECKPOINT/config.yaml --set train.out_dir=RUN --resume OUT_CHECKPOINT`
under any layout. Exit status: 0 done, 2 a user error (the message says what differs and the fix;
nothing is written), 1 reshard found a tensor that did not land. docs/convert.md has the details.
"""
from __future__ import annotations

import argparse
import sys

from ..checkpoint.errors import CheckpointError
from ..config import ConfigError
from .errors import ConvertError
from .model_tensors import DTYPES, KEEP
from .safetensors_io import DEFAULT_SHARD_SIZE

USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gdn-convert", description="Convert gdn_parallel checkpoints to and from Hugging Face "
        "(flash-linear-attention) folders and torch files, or check one under another layout.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dtype = dict(choices=[KEEP, *DTYPES], default=KEEP,
                 help="cast floating tensors (default: keep their dtype)")
    target = dict(default=None, metavar="FILE", help="the training config the new checkpoint is resumed with "
                  "(its model must match the weights; its data section fixes the data stream); default: the "
                  "source's model with default sections (required for a bare state dict)")
    checkpoint = dict(help="a checkpoint directory (<out_dir>/checkpoints/step_<N>) or a run's out_dir (its "
                      "newest complete checkpoint)")
    override = dict(dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a field of that config (repeatable)")

    to_hf = commands.add_parser("to-hf", help="checkpoint -> flash-linear-attention GatedDeltaNetForCausalLM "
                                "folder (KDAForCausalLM for a model with Kimi Delta Attention layers)")
    to_hf.add_argument("checkpoint", **checkpoint)
    to_hf.add_argument("out_dir", help="the folder to create (config.json, *.safetensors, "
                       "generation_config.json and the checkpoint's tokenizer: docs/convert.md); must not "
                       "exist")
    to_hf.add_argument("--dtype", **dtype)
    to_hf.add_argument("--shard-size", default=DEFAULT_SHARD_SIZE,
                       help=f"largest safetensors shard, e.g. 5GB, 500MB, 2GiB "
                            f"(default {DEFAULT_SHARD_SIZE})")

    to_torch = commands.add_parser("to-torch", help="checkpoint -> one torch file {'model', 'config'}")
    to_torch.add_argument("checkpoint", **checkpoint)
    to_torch.add_argument("file", help="the torch file to create; must not exist")
    to_torch.add_argument("--dtype", **dtype)

    for name, source, source_help, help_text in (
            ("from-hf", "hf_dir", "a folder with config.json (model_type gated_deltanet or kda) and "
             "model.safetensors or shards with their index",
             "Hugging Face folder (ours or fla's) -> step-0 checkpoint"),
            ("from-torch", "file", "a file written by to-torch, or torch.save(state_dict) with --config",
             "torch file (to-torch's, or a bare state dict with --config) -> step-0 checkpoint")):
        into = commands.add_parser(name, help=help_text)
        into.add_argument(source, help=source_help)
        into.add_argument("out_checkpoint", help="the checkpoint directory to create; must not exist")
        into.add_argument("--config", **target)
        into.add_argument("--set", **override)
        into.add_argument("--dtype", **dtype)

    reshard = commands.add_parser("reshard", help="load a checkpoint under a layout (under torchrun) and "
                                  "check every tensor landed")
    reshard.add_argument("checkpoint", **checkpoint)
    reshard.add_argument("--layout", required=True, metavar="tp=T,pp=P,cp=C,dp=D",
                         help="degrees (those not named are 1) and any other parallel.* field")
    reshard.add_argument("--out", default=None, metavar="DIR",
                         help="save it again from this layout into DIR/checkpoints/step_<N>, with "
                              "DIR/config.yaml to resume it (train.batch_size per replica rescaled to keep "
                              "the global batch)")
    reshard.add_argument("--set", **{**override,
                                     "help": "with --out: a train/checkpoint/log field of the written "
                                             "config.yaml, e.g. --set train.microbatch_size=1"})
    reshard.add_argument("--report", default="reshard_report.json", metavar="FILE",
                         help="the JSON report rank 0 writes (default ./reshard_report.json)")
    return parser


def run(args: argparse.Namespace) -> int:
    from . import commands
    if args.command == "to-hf":
        notes = []
        source = commands.to_hf(args.checkpoint, args.out_dir, args.dtype, args.shard_size, say=notes.append)
        print(f"to-hf | {source} -> {args.out_dir} | " + " | ".join(notes))
    elif args.command == "to-torch":
        source = commands.to_torch(args.checkpoint, args.file, args.dtype)
        print(f"to-torch | {source} -> {args.file}")
    elif args.command in ("from-hf", "from-torch"):
        convert = commands.from_hf if args.command == "from-hf" else commands.from_torch
        source = args.hf_dir if args.command == "from-hf" else args.file
        out = convert(source, args.out_checkpoint, args.config, args.overrides, args.dtype)
        print(f"{args.command} | {source} -> {out} (step 0)\n"
              f"resume with: gdn-train --config {out}/config.yaml --set train.out_dir=RUN_DIR --resume {out}")
    else:
        from .reshard import reshard
        return reshard(args.checkpoint, args.layout, args.out, args.report, overrides=args.overrides)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point: 0 done, 1 reshard mismatch, 2 a user error (message on stderr)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except (ConvertError, ConfigError, CheckpointError) as err:
        print(f"gdn-convert {args.command}: error: {err}", file=sys.stderr)
        return USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
