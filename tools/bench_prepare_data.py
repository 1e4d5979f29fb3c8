"""gdn-prepare-data's tokenizing rate against the tokenizer's own `encode_batch` on the same text and
cores (issue 44: >= 0.9x with 2 workers on one large JSON-lines file).

    python3 tools/bench_prepare_data.py                 # ~40 MB of documents of many lengths, 2 workers
    python3 tools/bench_prepare_data.py --mb 10 --workers 2 --repeats 3

The corpus: Python's standard library sources cut into documents of 200 B to 200 KB, as JSON lines; the
tokenizer: a byte-level BPE (8K vocabulary) trained on a sample of it. The reference is what a user
could do by hand with `tokenizers` alone: read the file, `encode_batch` every text with the library's
own threads on the same cores (TOKENIZERS_PARALLELISM on), keep the ids. The tool's run is the whole
command (start-up, shards, workers, writing tokens.bin and token_bytes.bin, joining). Each is timed
--repeats times, the best kept; the ratio is encode_batch's time over the tool's (1.0: as fast).
Prints one line and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def corpus(path: Path, megabytes: float, seed: int = 0) -> list[str]:
    """JSON lines of stdlib source pieces, 200 B to 200 KB (log-uniform), until `megabytes`."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    text = "".join(p.read_text(errors="replace") for p in sources[:2000])
    rng, texts, size = random.Random(seed), [], 0
    while size < megabytes * 1e6:
        length = int(10 ** rng.uniform(2.3, 5.3))
        start = rng.randrange(0, len(text) - length)
        texts.append(text[start:start + length])
        size += length
    with open(path, "w") as handle:
        for piece in texts:
            handle.write(json.dumps({"text": piece}) + "\n")
    return texts


def train_tokenizer(path: Path, texts: list[str]) -> None:
    import tokenizers
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts[:300], trainer)
    tokenizer.save(str(path))


def time_encode_batch(jsonl: Path, tokenizer_path: Path, cores: int) -> float:
    """encode_batch over the file's texts in a fresh process limited to `cores` (reading included)."""
    code = ("import json,sys,time,tokenizers\n"
            "t=time.perf_counter(); tok=tokenizers.Tokenizer.from_file(sys.argv[2])\n"
            "texts=[json.loads(line)['text'] for line in open(sys.argv[1])]\n"
            "ids=[e.ids for e in tok.encode_batch(texts)]\n"
            "print(time.perf_counter()-t)")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": str(cores)}
    out = subprocess.run([sys.executable, "-c", code, str(jsonl), str(tokenizer_path)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def time_tool(jsonl: Path, tokenizer_path: Path, out: Path, workers: int) -> float:
    command = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), str(jsonl), "--out", str(out),
               "--tokenizer", str(tokenizer_path), "--workers", str(workers), "--force"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mb", type=float, default=40.0, help="corpus size in MB")
    parser.add_argument("--workers", type=int, default=2,
                        help="the tool's --workers and encode_batch's threads")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_prepare_data.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        texts = corpus(work / "docs.jsonl", args.mb)
        train_tokenizer(work / "tokenizer.json", texts)
        raw = min(time_encode_batch(work / "docs.jsonl", work / "tokenizer.json", args.workers)
                  for _ in range(args.repeats))
        tool = min(time_tool(work / "docs.jsonl", work / "tokenizer.json", work / "out", args.workers)
                   for _ in range(args.repeats))
        tokens = json.loads((work / "out" / "gdn_tokens.json").read_text()).get("num_tokens")
    result = {"mb": args.mb, "documents": len(texts), "tokens": tokens, "workers": args.workers,
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "encode_batch_s": round(raw, 2), "prepare_data_s": round(tool, 2),
              "rate_ratio": round(raw / tool, 3)}
    print(f"prepare_data | {args.mb:g} MB, {len(texts)} documents, {args.workers} workers: "
          f"{tool:.1f} s against encode_batch's {raw:.1f} s: {raw / tool:.2f}x its rate (target 0.9x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
