"""The longest context per GPU that the memory model (gdn_parallel/train/memory_model.py) predicts to fit,
by config, GPU memory and memory setting: one sequence per step, full activation checkpointing, with
and without activation offload and chunked recomputation.

    python tools/context_per_gpu.py --configs configs/gdn-0.4b.yaml,configs/h1-1.3b.yaml \
        --gib 79.2,139.8 [--set model.residual_in_fp32=false]

Contexts are searched in steps of --step tokens. The prediction has been within 10% of the peak the
trainer measured (docs/benchmarks.md, "Memory at long context"); a context near a limit is worth a
short run first. The chunked rows (train.recompute_chunks=8) were checked at one point on a GPU
(h1-1.3b, 256K tokens, no offload, H100: 71.9 GiB measured, 72.3 predicted). Under context
parallelism the same figure is per rank: cp ranks carry cp times it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_parallel.config import Config  # noqa: E402
from gdn_parallel.train.memory_model import predict_peak  # noqa: E402

SETTINGS = {"full checkpointing": [], "+ 8 chunks": ["train.recompute_chunks=8"],
            "+ offload (all blocks)": ["train.activation_offload=cpu"],
            "+ offload, 8 chunks": ["train.activation_offload=cpu", "train.recompute_chunks=8"]}


def predicted(path: str, overrides: list[str], tokens: int):
    return predict_peak(Config.from_yaml(path, [
        "train.batch_size=1", "train.microbatch_size=1", "train.activation_checkpointing=full",
        f"train.seq_len={tokens}", *overrides]))


def longest(path: str, overrides: list[str], capacity_gib: float, step: int, limit: int) -> int:
    """The largest multiple of `step` up to `limit` tokens predicted to fit (0: none)."""
    def fits(tokens: int) -> bool:
        return predicted(path, overrides, tokens).peak_gib <= capacity_gib
    low, high = 0, limit // step
    while low < high:   # the peak grows with the context: bisect
        middle = (low + high + 1) // 2
        if fits(middle * step):
            low = middle
        else:
            high = middle - 1
    return low * step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="configs/gdn-0.4b.yaml,configs/h1-0.4b.yaml,configs/gdn-1.3b.yaml,"
                                        "configs/h1-1.3b.yaml")
    p.add_argument("--gib", default="79.2,139.8", help="GPU memory in GiB (H100 80 GB: 79.2; H200: 139.8)")
    p.add_argument("--step", type=int, default=16384)
    p.add_argument("--limit", type=int, default=1 << 23)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a config override for every row, e.g. model.residual_in_fp32=false (repeatable)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    capacities = [float(g) for g in args.gib.split(",")]
    rows = []
    print(f"{'config':14s} {'setting':24s} " + " ".join(f"{f'{c:.1f} GiB':>22s}" for c in capacities))
    for path in args.configs.split(","):
        for name, setting in SETTINGS.items():
            overrides = [*args.overrides, *setting]
            found = [longest(path, overrides, c, args.step, args.limit) for c in capacities]
            # offload needs the host memory to hold the inputs it moves there (page-locked)
            host = [predicted(path, overrides, t).offloaded_gib if t else 0.0 for t in found]
            rows.append({"config": path, "setting": name, "tokens": dict(zip(map(str, capacities), found)),
                         "host_gib": dict(zip(map(str, capacities), host))})
            cells = [f"{t // 1024:,}K" + (f" ({h:.0f} GiB host)" if h else "") for t, h in zip(found, host)]
            print(f"{Path(path).stem:14s} {name:24s} " + " ".join(f"{c:>22s}" for c in cells))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
