"""Tokenize text, JSON-lines or Parquet files into a prepared dataset that data.source reads.

    gdn-prepare-data corpus/ --out data/corpus-bytes  # raw bytes (python3 tools/prepare_data.py ...)
    gdn-prepare-data 'dump/*.jsonl' --out data/dump --tokenizer tokenizer.json --workers 8
    python3 -m gdn_parallel.train --set data.source=data/dump --set model.vocab_size=32000

The output directory gets tokens.bin (uint16 ids when the vocabulary fits, else uint32), offsets.npy
(the document index) and gdn_tokens.json (metadata, written last); with a tokenizer file also
token_bytes.bin (the UTF-8 bytes of the text each token stands for: val_bpb's denominator) and a copy
of the tokenizer.json with its special tokens (bos, eos, pad: from --bos-token ..., else transformers'
tokenizer_config.json beside the tokenizer file, else its post-processor template), which checkpoints
carry into Hugging Face exports. The format is described in gdn_parallel/data/prepared.py. Each text
file, JSON line or Parquet row is one document.

Work goes in shards (whole text files grouped up to --shard-mb of input, byte ranges of JSON-lines
files, row groups of Parquet files), tokenized by --workers processes into DIR/.partial/. With more
than one worker the shards are made smaller than --shard-mb where the inputs would otherwise give each
worker fewer than SHARDS_PER_WORKER of them (down to 1 MiB), so one large JSON-lines file is tokenized
by every worker. A shard is written under temporary names and renamed when complete, so an interrupted
run, started again with the same arguments, continues after the last completed shard. The shards are
joined in input order at the end: the output is byte for byte the same for any --workers and
--shard-mb. A finished directory is never overwritten without --force.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..config import DataConfig
from .prepare_inputs import holds_records, list_inputs, plan_items, read_texts, suffixes_with_records
from .prepared import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    OFFSETS_FILE,
    PARTIAL_DIR,
    TOKEN_BYTES_FILE,
    TOKENIZER_COPY,
    TOKENS_FILE,
    token_dtype,
)
from .text_tokenizer import SPECIAL_ROLES, load_tokenizer

PLAN_FILE = "plan.json"
ENCODE_BATCH = 256           # texts per tokenizer call
# with several workers, shards small enough that each worker gets this many: the last shards keep
# one worker busy while the others are done, a share of the run that falls with their size
SHARDS_PER_WORKER = 16
MIN_SPLIT_BYTES = 2 ** 20    # smaller shards gain no balance and add per-shard files
DEFAULT_TEXT_KEY = "text"
# the names written in --out (and each with .tmp)
OUR_NAMES = (METADATA_FILE, TOKENS_FILE, OFFSETS_FILE, PARTIAL_DIR, TOKEN_BYTES_FILE, TOKENIZER_COPY)
COUNT_DTYPES = ("uint8", "uint16", "uint32")   # token_bytes.bin: the narrowest that holds every count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdn-prepare-data", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("inputs", nargs="+", help="files, directories or glob patterns")
    parser.add_argument("--out", required=True, help="the dataset directory to write (data.source)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="'bytes' (UTF-8 bytes, vocabulary 256) or a Hugging Face tokenizers JSON file")
    parser.add_argument("--text-key", default=None,
                        help=f"the text field of JSON lines / Parquet rows (default {DEFAULT_TEXT_KEY!r}); "
                             f"text files have none")
    for role in SPECIAL_ROLES:
        parser.add_argument(f"--{role.replace('_', '-')}", dest=role, default=None, metavar="TOKEN",
                            help=f"the tokenizer's {role.split('_')[0]} token (default: as "
                                 f"tokenizer_config.json beside the tokenizer file, else its post-processor "
                                 f"template, names it)")
    default_suffixes = ",".join(suffixes_with_records(DataConfig().suffixes))
    parser.add_argument("--suffixes", default=default_suffixes,
                        help=f"files a directory input takes ('*': all); default {default_suffixes}")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--shard-mb", type=float, default=64.0, help="input megabytes per shard")
    parser.add_argument("--force", action="store_true",
                        help="overwrite a finished dataset (or restart an unfinished one) in --out")
    parser.add_argument("--progress", choices=("auto", "bar", "lines", "off"), default="auto",
                        help="a progress bar on a terminal, plain lines otherwise (auto)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        summary = prepare(args)
    except (ValueError, OSError) as err:
        print(f"gdn-prepare-data: error: {err}", file=sys.stderr)
        return 2
    print(f"prepared {summary['num_documents']:,} documents, {summary['num_tokens']:,} tokens "
          f"({summary['dtype']}, max id {summary['max_token_id']}) in {args.out}")
    return 0


def prepare(args) -> dict:
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} must be >= 1")
    if not args.shard_mb > 0:
        raise ValueError(f"--shard-mb={args.shard_mb} must be > 0")
    suffixes = DataConfig.parse_suffixes(args.suffixes)
    if suffixes is None:
        raise ValueError(f"--suffixes={args.suffixes!r} must be suffixes separated by commas, e.g. "
                         f"'.txt,.jsonl', or '*'")
    out = Path(args.out).expanduser()
    tokenizer = process_tokenizer(args.tokenizer, special_tokens_given(args), reload=True)
    files = list_inputs(args.inputs, suffixes)
    text_key = resolve_text_key(args.text_key, files)
    check_output_dir(out, args.force)       # after the inputs: --force deletes nothing for a typo
    shard_bytes = max(1, int(args.shard_mb * 2 ** 20))
    # the fingerprint holds --shard-mb as asked, not as cut for the workers: a run resumes under
    # another --workers with the plan it saved (the output does not depend on either)
    fingerprint = {"format_version": FORMAT_VERSION, "tokenizer": tokenizer.identity(),
                   "text_key": text_key, "dtype": token_dtype(tokenizer.vocab_size),
                   "shard_bytes": shard_bytes, "counts_text_bytes": True,
                   "inputs": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    plan: dict[str, Any] = {"fingerprint": fingerprint}
    partial = out / PARTIAL_DIR
    split_bytes = shard_size(shard_bytes, sum(f.stat().st_size for f in files), args.workers)
    plan["shards"] = load_or_write_plan(partial, plan, files, split_bytes)
    run_shards(partial, plan, args, text_key)
    return assemble(out, partial, plan, tokenizer, text_key, files)


def resolve_text_key(given: str | None, files: list[Path]) -> str:
    """--text-key, which only JSON-lines and Parquet inputs have: refused where every input is text."""
    if given is not None and not holds_records(files):
        names = ", ".join(f.name for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise ValueError(f"--text-key {given!r} names the text field of JSON-lines / Parquet records, but "
                         f"the inputs ({names}) are text files, each one whole document: drop --text-key")
    return DEFAULT_TEXT_KEY if given is None else given


def shard_size(requested: int, input_bytes: int, workers: int) -> int:
    """Input bytes per shard: `requested` (--shard-mb), or with several workers less where the inputs
    would give each worker fewer than SHARDS_PER_WORKER shards, but not under MIN_SPLIT_BYTES."""
    if workers <= 1:
        return requested
    even_share = -(-input_bytes // (workers * SHARDS_PER_WORKER))
    return min(requested, max(even_share, MIN_SPLIT_BYTES))


def special_tokens_given(args) -> dict:
    return {role: getattr(args, role, None) for role in SPECIAL_ROLES}


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse a finished dataset without --force, and a directory holding anything but ours."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if not out.exists():
        return
    foreign = sorted(p.name for p in out.iterdir() if not p.name.startswith(tuple(OUR_NAMES)))
    if foreign:
        raise ValueError(f"--out {out} holds other files ({', '.join(foreign[:5])}); give a new or empty "
                         f"directory")
    if (out / METADATA_FILE).exists() and not force:
        raise ValueError(f"--out {out} already holds a finished dataset; pass --force to overwrite it")
    if force:
        for path in out.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def load_or_write_plan(partial: Path, plan: dict, files: list[Path], shard_bytes: int) -> list[list[dict]]:
    """The shards of an unfinished run with the same fingerprint (resume), else a new plan."""
    plan_path = partial / PLAN_FILE
    if plan_path.is_file():
        saved = json.loads(plan_path.read_text(encoding="utf-8"))
        if saved.get("fingerprint") != plan["fingerprint"]:
            raise ValueError(f"{partial} holds an unfinished preparation of other inputs or arguments "
                             f"(or the inputs changed since); run it with the same arguments to resume, or "
                             f"pass --force to start over")
        return saved["shards"]
    if partial.exists():        # interrupted before its plan was written: nothing to keep
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    shards = group_into_shards([item for f in files for item in plan_items(f, shard_bytes)], shard_bytes)
    write_atomically(plan_path, json.dumps({**plan, "shards": shards}).encode("utf-8"))
    return shards


def group_into_shards(items: list[dict], shard_bytes: int) -> list[list[dict]]:
    """Consecutive work items, up to `shard_bytes` of input per shard (an item larger goes alone)."""
    shards: list[list[dict]] = []
    size = 0
    for item in items:
        if not shards or size + item["bytes"] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item["bytes"]
    return shards


def shard_paths(partial: Path, index: int) -> dict:
    stem = partial / f"shard_{index:06d}"
    return {"tokens": stem.with_suffix(".bin"), "lengths": stem.with_suffix(".lengths.npy"),
            "text_bytes": stem.with_suffix(".bytes.bin"), "summary": stem.with_suffix(".json")}


def shard_done(partial: Path, index: int) -> bool:
    return shard_paths(partial, index)["summary"].is_file()   # renamed last: the shard's commit


def run_shards(partial: Path, plan: dict, args, text_key: str) -> None:
    shards = plan["shards"]
    pending = [i for i in range(len(shards)) if not shard_done(partial, i)]
    total = sum(item["bytes"] for shard in shards for item in shard)
    done = total - sum(item["bytes"] for i in pending for item in shards[i])
    progress = Progress(total, done, len(shards), len(shards) - len(pending), args.progress)
    fingerprint = plan["fingerprint"]
    tasks = [(i, shards[i], str(partial), fingerprint["dtype"], text_key) for i in pending]
    special = special_tokens_given(args)
    try:
        if args.workers == 1 or len(tasks) <= 1:
            for task in tasks:
                progress.advance(prepare_shard(task))
        else:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # processes, not threads, share work
            with multiprocessing.Pool(args.workers, initializer=process_tokenizer,
                                      initargs=(args.tokenizer, special)) as pool:
                for summary in pool.imap_unordered(prepare_shard, tasks):
                    progress.advance(summary)
    finally:
        progress.close()


_TOKENIZER = None
_TOKENIZER_SOURCE = None     # the (spec, special tokens) _TOKENIZER was loaded from


def process_tokenizer(spec: str, special: dict | None = None, reload: bool = False):
    """This process's tokenizer, loaded unless it has it already (`reload`: load it anew): a forked
    worker inherits the one prepare() loaded, which saves a fraction of a second per worker."""
    global _TOKENIZER, _TOKENIZER_SOURCE
    source = (spec, sorted((special or {}).items()))
    if reload or _TOKENIZER is None or _TOKENIZER_SOURCE != source:
        _TOKENIZER, _TOKENIZER_SOURCE = load_tokenizer(spec, special), source
    return _TOKENIZER


def prepare_shard(task) -> dict:
    """Tokenize one shard into DIR/.partial/shard_N.{bin,lengths.npy,bytes.bin,json} (temporary names
    first); bytes.bin (uint32 per token, the text's UTF-8 bytes it stands for) only for a tokenizer file."""
    index, items, partial, dtype_name, text_key = task
    tokenizer = _TOKENIZER
    if tokenizer is None:
        raise RuntimeError("prepare_shard runs after process_tokenizer, which loads the tokenizer")
    paths = shard_paths(Path(partial), index)
    tmp = {name: path.with_name(path.name + ".tmp") for name, path in paths.items()}
    counts: Counter = Counter()
    with ShardWriter(tmp, dtype_name) as writer:
        for texts in batched(text for item in items for text in read_texts(item, text_key, counts)):
            writer.add(*tokenizer.encode_joined(texts))
    counts["empty_documents"] += writer.empty_documents
    summary = {"index": index, "bytes": sum(item["bytes"] for item in items), **writer.summary(), **counts}
    tmp["summary"].write_text(json.dumps(summary), encoding="utf-8")
    for name in ("tokens", "lengths", "text_bytes", "summary"):   # the summary last: the shard's commit
        os.replace(tmp[name], paths[name])
    return summary


class ShardWriter:
    """A shard's tokens, document lengths and per-token text bytes, written a batch at a time."""

    def __init__(self, tmp: dict[str, Path], dtype_name: str):
        self.tmp, self.dtype_name = tmp, dtype_name
        self.dtype = np.dtype(dtype_name).newbyteorder("<")
        self.lengths: list[np.ndarray] = []
        self.max_id, self.num_tokens, self.text_bytes, self.max_token_bytes = -1, 0, 0, 1
        self.empty_documents = 0

    def __enter__(self) -> ShardWriter:
        self.tokens = open(self.tmp["tokens"], "wb")
        self.token_bytes = open(self.tmp["text_bytes"], "wb")
        return self

    def __exit__(self, *exc) -> None:
        self.tokens.close()
        self.token_bytes.close()
        if exc[0] is None:
            with open(self.tmp["lengths"], "wb") as fh:
                np.save(fh, np.concatenate(self.lengths or [np.zeros(0, dtype=np.int64)]))

    def add(self, ids: np.ndarray, lengths: np.ndarray, token_bytes: np.ndarray | None) -> None:
        """One batch (a tokenizer's encode_joined); documents without tokens are counted, not written."""
        self.empty_documents += int(np.count_nonzero(lengths == 0))
        self.lengths.append(lengths[lengths > 0])
        if ids.size == 0:
            return
        self.max_id = max(self.max_id, int(ids.max()))
        if self.max_id > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {self.max_id} does not fit {self.dtype_name}")
        self.tokens.write(ids.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += int(ids.size)
        if token_bytes is None:
            self.text_bytes += int(ids.size)
        else:
            self.token_bytes.write(token_bytes.astype("<u4").tobytes())
            self.max_token_bytes = max(self.max_token_bytes, int(token_bytes.max()))
            self.text_bytes += int(token_bytes.sum())

    def summary(self) -> dict:
        return {"documents": int(sum(len(lengths) for lengths in self.lengths)), "tokens": self.num_tokens,
                "max_token_id": self.max_id, "text_bytes": self.text_bytes,
                "max_token_bytes": self.max_token_bytes}


def batched(texts, size: int = ENCODE_BATCH):
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def assemble(out: Path, partial: Path, plan: dict, tokenizer, text_key: str, files: list[Path]) -> dict:
    """Join the shards into tokens.bin, offsets.npy (and token_bytes.bin, the tokenizer's copy), then
    write the metadata (the commit)."""
    tokenizer_identity = tokenizer.identity()
    summaries = [json.loads(shard_paths(partial, i)["summary"].read_text(encoding="utf-8"))
                 for i in range(len(plan["shards"]))]
    skipped = {key: sum(s.get(key, 0) for s in summaries) for key in ("binary_files", "empty_documents")}
    num_documents = sum(s["documents"] for s in summaries)
    if num_documents == 0:
        raise ValueError(f"the inputs hold no documents ({skipped['binary_files']} binary file(s), "
                         f"{skipped['empty_documents']} empty document(s) skipped)")
    dtype = plan["fingerprint"]["dtype"]
    lengths = []
    with open(out / (TOKENS_FILE + ".tmp"), "wb") as tokens:
        for i in range(len(summaries)):
            with open(shard_paths(partial, i)["tokens"], "rb") as shard:
                shutil.copyfileobj(shard, tokens, 16 * 2 ** 20)
            lengths.append(np.load(shard_paths(partial, i)["lengths"]))
    offsets = np.zeros(num_documents + 1, dtype=np.int64)
    np.cumsum(np.concatenate(lengths), out=offsets[1:])
    with open(out / (OFFSETS_FILE + ".tmp"), "wb") as fh:
        np.save(fh, offsets)
    text_bytes: dict = {"num_bytes": sum(s["text_bytes"] for s in summaries), "each_token": 1}
    written = [TOKENS_FILE, OFFSETS_FILE]
    if not tokenizer.one_byte_per_token:
        text_bytes = {"num_bytes": text_bytes["num_bytes"], "file": TOKEN_BYTES_FILE,
                      "dtype": join_token_bytes(out, partial, summaries)}
        copy_tokenizer(out, tokenizer_identity)
        written += [TOKEN_BYTES_FILE, TOKENIZER_COPY]
    metadata = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dtype": dtype,
        "vocab_size": tokenizer_identity["vocab_size"],
        "max_token_id": max(s["max_token_id"] for s in summaries),
        "num_tokens": int(offsets[-1]), "num_documents": num_documents,
        "tokenizer": tokenizer_identity, "text_key": text_key, "text_bytes": text_bytes,
        **({} if tokenizer.one_byte_per_token else {"tokenizer_copy": TOKENIZER_COPY}),
        "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
        "skipped": skipped, "created_by": "gdn-prepare-data",
    }
    (out / (METADATA_FILE + ".tmp")).write_text(json.dumps(metadata, indent=1), encoding="utf-8")
    for name in written + [METADATA_FILE]:   # the metadata last: the dataset's commit
        os.replace(out / (name + ".tmp"), out / name)
    shutil.rmtree(partial)
    return metadata


def join_token_bytes(out: Path, partial: Path, summaries: list[dict]) -> str:
    """The shards' per-token byte counts (uint32) into token_bytes.bin.tmp in the narrowest dtype
    that holds the largest; returns that dtype."""
    largest = max(s["max_token_bytes"] for s in summaries)
    dtype = next(name for name in COUNT_DTYPES if largest <= np.iinfo(name).max)
    with open(out / (TOKEN_BYTES_FILE + ".tmp"), "wb") as joined:
        for i in range(len(summaries)):
            counts = np.fromfile(shard_paths(partial, i)["text_bytes"], dtype="<u4")
            joined.write(counts.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    return dtype


def copy_tokenizer(out: Path, identity: dict) -> None:
    """The tokenizer file, as it was when the preparation started (its sha256), to tokenizer.json.tmp."""
    data = Path(identity["file"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != identity["sha256"]:
        raise ValueError(f"--tokenizer {identity['file']} changed while the data was prepared (its sha256 "
                         f"differs from the one the tokens were made with); prepare again with --force")
    (out / (TOKENIZER_COPY + ".tmp")).write_bytes(data)


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Progress:
    """Input bytes done: a bar redrawn in place on a terminal, else a line every 10% or 30 s."""

    def __init__(self, total: int, done: int, shards: int, shards_done: int, mode: str):
        self.total, self.done, self.shards, self.shards_done = max(total, 1), done, shards, shards_done
        self.bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.quiet = mode == "off"
        self.start, self.start_done = time.monotonic(), done
        self.last_line, self.last_tenth = 0.0, -1
        if shards_done and not self.quiet:
            print(f"resuming: {shards_done}/{shards} shards already done", file=sys.stderr, flush=True)

    def advance(self, summary: dict) -> None:
        self.done += summary["bytes"]
        self.shards_done += 1
        if self.quiet:
            return
        fraction = min(self.done / self.total, 1.0)
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        eta = f"{(self.total - self.done) / rate:.0f}s" if rate > 0 else "?"
        text = (f"{fraction:6.1%} {self.done / 2 ** 20:,.1f}/{self.total / 2 ** 20:,.1f} MB, shard "
                f"{self.shards_done}/{self.shards}, {rate / 2 ** 20:.1f} MB/s, eta {eta}")
        if self.bar:
            filled = int(30 * fraction)
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}", end="", file=sys.stderr, flush=True)
        elif int(fraction * 10) > self.last_tenth or elapsed - self.last_line > 30:
            self.last_tenth, self.last_line = int(fraction * 10), elapsed
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar and not self.quiet:
            print(file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
