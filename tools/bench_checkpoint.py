"""What checkpoint checksums cost: a model's save and load, with the checksum and verification parts
timed inside them (one process; the trainer's own saver and loader).

    python3 tools/bench_checkpoint.py --config configs/gdn-1.3b.yaml --dir /tmp/ckpt --json out.json

The model (its parameters in fp32) and AdamW state (slots created as the optimizer creates them) are
built on the GPU when there is one, as a one-GPU run holds them. Save = CheckpointSaver.save (DCP
write, RNG file, checksums hashed by a thread pool, seal); load = loading.load after verification
(resolve_resume), into the same model, against the same load unverified: after an untimed warm-up
load, `--repeats` loads of each kind alternate, medians reported. `--cold` drops the page cache
before each timed load (root only), as a job restarted on another node reads its checkpoint from
disk.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdn_parallel.checkpoint import CheckpointSaver, load_checkpoint, loading, manager  # noqa: E402
from gdn_parallel.checkpoint.state import ensure_optimizer_state  # noqa: E402
from gdn_parallel.config import Config  # noqa: E402
from gdn_parallel.model import build_model  # noqa: E402
from gdn_parallel.runtime.session import process_group  # noqa: E402
from gdn_parallel.train.optim import build_optimizer  # noqa: E402


class Stopwatch:
    """Wraps a function so that the time spent inside it adds up."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.seconds = owner, name, 0.0
        self.original = getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gdn-1.3b.yaml")
    parser.add_argument("--dir", default="/tmp/bench-checkpoint",
                        help="where the checkpoint is written (removed)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before the load (root)")
    parser.add_argument("--repeats", type=int, default=2, help="timed loads of each kind (median reported)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = Config.from_yaml(args.config, [f"train.out_dir={args.dir}", "train.device=auto"])
    shutil.rmtree(args.dir, ignore_errors=True)
    with process_group(config.train) as (device, _):
        model = build_model(config.model, device, seed=0)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, config.train, device)
        ensure_optimizer_state(optimizer)
        named = list(model.named_parameters())
        hashing = Stopwatch(manager, "_shared_checksums")
        start = time.perf_counter()
        CheckpointSaver(args.dir).save(1, named, optimizer, None, config, data_stream={})
        save_s = time.perf_counter() - start
        path = Path(args.dir) / "checkpoints" / "step_1"
        size = sum(p.stat().st_size for p in path.iterdir())
        # the small files first, the data files while they load
        verifying = Stopwatch(loading, "_local_damage")

        def timed_load() -> float:
            start = time.perf_counter()
            found = loading.resolve_resume("auto", args.dir)
            load_checkpoint(found, named, optimizer, None, config, same_layout=lambda saved: True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - start
        verify, skip = verifying.original, (lambda *args, **kwargs: None)
        verifying.original = skip
        timed_load()   # warm-up, unverified and untimed: the first load pays for allocations and CUDA set-up
        times: dict = {"verified": [], "unverified": []}
        cold = False
        for _ in range(args.repeats):   # alternating, so that drift hits both alike
            for kind in ("unverified", "verified"):
                verifying.original = verify if kind == "verified" else skip
                # a full collection inside one load is worth 0.2 s of noise even on the tiny model
                gc.collect()
                cold = drop_page_cache() if args.cold else False
                times[kind].append(timed_load())
        load_s, unverified_s = statistics.median(times["verified"]), statistics.median(times["unverified"])
        verify_s = verifying.seconds / args.repeats
    result = {"config": args.config,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "cpus": os.cpu_count(), "bytes": size,
              "parameters": sum(p.numel() for p in params), "save_s": save_s, "checksum_s": hashing.seconds,
              "load_s": load_s, "verify_s": verify_s, "load_unverified_s": unverified_s, "cold_cache": cold}
    result["checksum_share_of_save"] = hashing.seconds / save_s
    result["load_overhead"] = load_s / unverified_s - 1
    print(f"checkpoint of {args.config}: {size / 2 ** 30:.2f} GiB ({result['parameters']:,} parameters + "
          f"AdamW) on {result['device']}, {result['cpus']} CPUs")
    print(f"save {save_s:6.2f} s, of which checksums {hashing.seconds:5.2f} s "
          f"({100 * result['checksum_share_of_save']:.1f}%)")
    print(f"load {load_s:6.2f} s, verifying {verify_s:5.2f} s of it (the data files alongside the reading)"
          f"; unverified {unverified_s:6.2f} s (verification adds {100 * result['load_overhead']:.1f}%)"
          f"{' (cold page cache before each load)' if cold else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
