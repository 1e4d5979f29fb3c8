"""Long-context quality: passkey retrieval by context length and needle depth, and the held-out loss by
position in the document (gdn_parallel/data/passkey.py has the task). Console script `gdn-eval-niah`;
`python3 tools/eval_niah.py` runs the same.

    # a training set of the task itself (text files, one sample each; bytes)
    gdn-eval-niah make-data --out data/passkey --docs 4000 --min-length 160 --max-length 1024
    python3 -m gdn_parallel.train --config configs/tiny-cpu.yaml --set data.source=data/passkey \\
        --set train.seq_len=1024 --set train.out_dir=runs/passkey
    # a checkpoint (or run directory) saved under any layout
    gdn-eval-niah eval runs/passkey --lengths 256,512,1024,2048 --depths 0,0.25,0.5,0.75,1 \\
        --samples 20 --cp 2 --out results/passkey

A sample counts as retrieved when greedy decoding would write the whole number: the model's top token
at every answer position, given the true digits before it, is the true digit (one forward per sample).
`--cp N` names, for each sample, the context-parallel rank its needle falls on when the sequence is
split into N equal shards (the question is always on the last): the table then compares needles on
another rank with needles on the question's own. The layouts compute the same function (gdn-verify),
so the model is evaluated on one device. Writes niah.json, niah.png (heat map: accuracy by length and
depth) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import IGNORE_INDEX, Config, ConfigError
from ..convert import ConvertError, model_from_checkpoint
from ..data import TokenBatches
from ..data.passkey import PasskeySample, PasskeyTask, documents
from ..data.prepared import describe_tokenizer, is_prepared_dir, read_metadata
from ..data.text_tokenizer import ByteTokenizer, load_tokenizer
from ..runtime.session import resolve_device
from ..train.evaluation import position_buckets
from ..train.optim import autocast_dtype

PROG = "gdn-eval-niah"


# ---------------------------------------------------------------------------- make-data
def make_data(out: Path, docs: int, min_length: int, max_length: int, seed: int) -> int:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{PROG} make-data: --out {out} is not empty; give a new directory")
    try:
        texts = documents(docs, min_length, max_length, seed)
    except ValueError as err:
        raise SystemExit(f"{PROG} make-data: --min-length/--max-length: {err}") from None
    out.mkdir(parents=True, exist_ok=True)
    width = len(str(docs))
    for i, text in enumerate(texts):
        (out / f"passkey_{i:0{width}d}.txt").write_text(text, encoding="utf-8")
    return len(texts)


# ---------------------------------------------------------------------------- scoring
def tokenizer_for(saved_config: dict, override: str | None):
    """The run's tokenizer: --tokenizer, else a prepared data.source's (from its metadata), else bytes."""
    if override:
        return load_tokenizer(override)
    source = saved_config.get("data", {}).get("source", "stdlib")
    if is_prepared_dir(source):
        identity = read_metadata(source).get("tokenizer", {})
        if identity.get("kind") != "bytes":
            path = identity.get("file")
            tokenizer = load_tokenizer(path) if path and Path(path).is_file() else None
            if tokenizer is None or tokenizer.sha256 != identity.get("sha256"):
                raise SystemExit(f"{PROG}: the run's data.source={source!r} was tokenized by "
                                 f"{describe_tokenizer(identity)}, which is not at that path here (or has "
                                 f"changed); give --tokenizer with that tokenizer.json")
            return tokenizer
    return ByteTokenizer()


@torch.no_grad()
def answer_hits(model, samples: Sequence[PasskeySample], device, autocast: torch.dtype | None) -> np.ndarray:
    """[len(samples), answer length] booleans: the model's top token is the true one at each answer
    position (the true digits before it given). Samples of one call have one length."""
    ids = torch.as_tensor(np.stack([s.ids for s in samples]), device=device)
    start = samples[0].answer_start
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        logits = model(ids).logits[:, start - 1:-1]        # the predictions of tokens start .. length - 1
    return (logits.argmax(-1) == ids[:, start:]).cpu().numpy()


def needle_rank(sample: PasskeySample, cp: int) -> int:
    """The CP rank holding the needle's first token when the sample is cut into cp equal shards."""
    return sample.needle_start * cp // sample.length


def score_grid(model, task: PasskeyTask, lengths, depths, per_cell: int, seed: int, cp: int, batch: int,
               device, autocast) -> list[dict]:
    cells = []
    for length in lengths:
        for depth in depths:
            samples = task.grid([length], [depth], per_cell, seed)
            hits = np.concatenate([answer_hits(model, samples[i:i + batch], device, autocast)
                                   for i in range(0, len(samples), batch)])
            exact = hits.all(axis=1)
            ranks = [needle_rank(s, cp) for s in samples]
            cells.append({"length": length, "depth": depth, "samples": len(samples),
                          "accuracy": float(exact.mean()), "digit_accuracy": float(hits.mean()),
                          "needle_ranks": sorted(set(ranks)),
                          "retrieved_by_needle_rank": {str(r): [int(e) for e, rr in zip(exact, ranks)
                                                                if rr == r]
                                                       for r in sorted(set(ranks))}})
    return cells


def by_rank_summary(cells: list[dict], cp: int) -> dict[str, dict]:
    """Accuracy of needles on the question's rank (the last) against needles on other ranks."""
    groups = {"same rank as the question": [], "another rank": []}
    for cell in cells:
        for rank, results in cell["retrieved_by_needle_rank"].items():
            key = "same rank as the question" if int(rank) == cp - 1 else "another rank"
            groups[key].extend(results)
    return {k: {"samples": len(v), "accuracy": (sum(v) / len(v)) if v else None} for k, v in groups.items()}


@torch.no_grad()
def loss_by_position(model, data_config, seq_len: int, rows: int, device, autocast) -> dict[str, dict]:
    """{bucket: {"loss", "tokens"}}: the held-out loss per position bucket (position inside the
    document) over the first `rows` packed rows of the validation split (fewer if it has fewer)."""
    stream = TokenBatches.from_config(data_config, seq_len, 1, split="val", epochs=1, drop_last=False)
    sums, counts = {}, {}
    buckets = position_buckets(seq_len)
    for _, row in zip(range(rows), stream):
        row = row.to(device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = model(row.input_ids, cu_seqlens=row.cu_seqlens, position_ids=row.position_ids).logits
        labelled = row.labels != IGNORE_INDEX
        losses = torch.nn.functional.cross_entropy(logits.float()[labelled], row.labels[labelled],
                                                   reduction="none")
        positions = row.position_ids[labelled]
        for lo, hi in buckets:
            inside = (positions >= lo) & (positions < hi)
            if inside.any():
                name = f"{lo}-{hi}"
                sums[name] = sums.get(name, 0.0) + float(losses[inside].sum())
                counts[name] = counts.get(name, 0) + int(inside.sum())
    return {name: {"loss": sums[name] / counts[name], "tokens": counts[name]} for name in sums}


# ---------------------------------------------------------------------------- report
def table(cells: list[dict], lengths, depths) -> str:
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    head = "depth \\ length | " + " | ".join(str(n) for n in lengths)
    lines = [head, "-" * len(head)]
    for depth in depths:
        lines.append(f"{depth:<14g} | " + " | ".join(f"{acc[(n, depth)]:>{len(str(n))}.2f}" for n in lengths))
    return "\n".join(lines)


def plot(cells: list[dict], lengths, depths, title: str, out: Path) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"{PROG}: the heat map needs matplotlib (pip install matplotlib), "
                         "or give --no-plot") from None
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    grid = np.array([[acc[(n, d)] for n in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.2 + 0.6 * len(depths)))
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="passkey retrieved")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- command line
def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{PROG}: {flag} {text!r}: give a comma-separated list of numbers") from None
    if not values:
        raise SystemExit(f"{PROG}: {flag} is empty")
    return values


def evaluate_checkpoint(args) -> dict:
    lengths = _numbers(args.lengths, int, "--lengths")
    depths = _numbers(args.depths, float, "--depths")
    if args.cp < 1 or any(n % args.cp for n in lengths):
        raise SystemExit(f"{PROG}: --cp {args.cp} must be >= 1 and divide every length in --lengths "
                         f"(CP shards are equal)")
    try:
        device = resolve_device(args.device)  # the trainer's rule for train.device
    except ConfigError as err:
        raise SystemExit(f"{PROG}: --device {args.device}: {err}") from None
    try:
        model, saved = model_from_checkpoint(args.checkpoint, device)
    except (ConvertError, FileNotFoundError) as err:
        raise SystemExit(f"{PROG}: {err}") from None
    model.eval()
    autocast = autocast_dtype(args.dtype, device)
    config = saved.get("config", {})
    task = PasskeyTask(tokenizer_for(config, args.tokenizer))
    if min(lengths) < task.min_length():
        raise SystemExit(f"{PROG}: --lengths: {min(lengths)} is shorter than the task "
                         f"({task.min_length()} tokens)")
    vocab = model.config.vocab_size
    cells = score_grid(model, task, lengths, depths, args.samples, args.seed, args.cp, args.batch, device,
                       autocast)
    result = {"checkpoint": str(args.checkpoint), "device": str(device),
              "dtype": args.dtype if autocast else "float32", "vocab_size": vocab, "lengths": lengths,
              "depths": depths, "samples_per_cell": args.samples,
              "seed": args.seed, "cp": args.cp, "cells": cells,
              "accuracy_by_needle_rank": by_rank_summary(cells, args.cp) if args.cp > 1 else None,
              "trained_seq_len": config.get("train", {}).get("seq_len")}
    if args.position_rows > 0:
        data = Config.from_dict({"data": config.get("data", {})}).data
        if args.data:
            data.source = args.data
        try:
            result["loss_by_position"] = loss_by_position(model, data, max(lengths), args.position_rows,
                                                          device, autocast)
        except ConfigError as err:
            raise SystemExit(f"{PROG}: loss by position (--position-rows 0 skips it): {err}") from None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-data", help="write passkey samples as text files (a training set)")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--docs", type=int, default=4000)
    make.add_argument("--min-length", type=int, default=160)
    make.add_argument("--max-length", type=int, default=1024)
    make.add_argument("--seed", type=int, default=0)
    ev = sub.add_parser("eval", help="accuracy by length and depth, loss by position")
    ev.add_argument("checkpoint", help="a checkpoint step_N directory or a run's train.out_dir (newest)")
    ev.add_argument("--lengths", default="256,512,1024")
    ev.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ev.add_argument("--samples", type=int, default=20, help="samples per (length, depth)")
    ev.add_argument("--batch", type=int, default=8)
    ev.add_argument("--seed", type=int, default=1234, help="the samples' seed (training data used 0)")
    ev.add_argument("--cp", type=int, default=1, help="report needles by the CP rank they fall on")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="autocast on CUDA (CPU runs fp32)")
    ev.add_argument("--tokenizer", help="bytes or a tokenizer.json (default: the run's)")
    ev.add_argument("--data", help="held-out data for the loss by position (default: the run's data.source)")
    ev.add_argument("--position-rows", type=int, default=4,
                    help="held-out rows for the loss by position (0: skip)")
    ev.add_argument("--out", type=Path, help="directory for niah.json and niah.png")
    ev.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "make-data":
        count = make_data(args.out, args.docs, args.min_length, args.max_length, args.seed)
        print(f"make-data | {count} passkey documents of {args.min_length}-{args.max_length} bytes in "
              f"{args.out}")
        return 0
    if args.samples < 1 or args.batch < 1:
        raise SystemExit(f"{PROG}: --samples and --batch must be >= 1")
    result = evaluate_checkpoint(args)
    print(f"passkey retrieval ({result['samples_per_cell']} samples per cell, {result['device']}, "
          f"trained at seq_len {result['trained_seq_len']})")
    print(table(result["cells"], result["lengths"], result["depths"]))
    if result["accuracy_by_needle_rank"]:
        for group, value in result["accuracy_by_needle_rank"].items():
            acc = "n/a" if value["accuracy"] is None else f"{value['accuracy']:.3f}"
            print(f"cp={args.cp} needle on {group}: {acc} ({value['samples']} samples)")
    if result.get("loss_by_position"):
        print("held-out loss by position: " + ", ".join(f"{k} {v['loss']:.3f} ({v['tokens']:,} tokens)"
                                                        for k, v in result["loss_by_position"].items()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "niah.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        if not args.no_plot:
            title = f"{Path(args.checkpoint).name}: passkey retrieved ({args.samples}/cell)"
            plot(result["cells"], result["lengths"], result["depths"], title, args.out / "niah.png")
        print(f"wrote {args.out / 'niah.json'}" + ("" if args.no_plot else f" and {args.out / 'niah.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
