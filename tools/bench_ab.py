"""The trainer of two source trees on one machine in one run, config by config: a change measured as
users run it, against the commit before it.

    mkdir -p .bench_baseline && git archive <ref> | tar -x -C .bench_baseline    # the other tree
    python3 tools/bench_ab.py --baseline .bench_baseline --configs configs/gdn-0.4b.yaml,configs/h1-0.4b.yaml
    python3 tools/bench_ab.py --baseline . --this-set model.residual_in_fp32=false --configs ...  # a setting

(On the device machine, carry the baseline folder: it is git-ignored.) Each config trains --steps
steps in each tree, the baseline first, each tree with its own copy of the config and its own kernels
(tools/gpu_smoke.py's run: `python -m gdn_parallel.train` at the config's batch, warmup 2, logging
every step unless --set train.log_every says otherwise, train.profile_steps over --profile). Per tree:
the median tokens/s over the logged intervals from the third step on, leaving out those that hold a
profiled step or the step after them (the profiler waits for the device);
MFU, peak memory, and the profile's wall and busy time per step, GPU idle share and buckets; then the
steady steps' wall time and their idle share (the profile's busy time against it: the profiler's own
work slows the host, so the profiled steps can idle where the others do not). Per config
the ratio of this tree's tokens/s to the baseline's. A table on stdout, JSON in --out/bench_ab.json and,
with matplotlib, the buckets side by side in --out/bench_ab.png.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import REPO, run_config  # noqa: E402

from gdn_parallel.train.metrics_sinks import read_metrics  # noqa: E402  (gpu_smoke put the repo on the path)
from gdn_parallel.train.profiling import steady_idle_share  # noqa: E402
from tools.bench_common import median_step_ms, steady_records  # noqa: E402


def kernels_path(tree: Path, folder: Path) -> str:
    """PYTHONPATH with `folder`, whose `gdn_kernels` is the tree's `kernels/`, first: each tree runs
    its own kernels whatever package is installed."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "gdn_kernels"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(tree.resolve() / "kernels", target_is_directory=True)
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(folder), str(tree.resolve()), rest) if p)


def summarise(run_dir: Path, profile: tuple[int, int]) -> dict:
    """Median tokens/s and MFU outside the warm-up and the profiled window, peak memory, profile table."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []  # a run killed on its timeout: torn line
    steps = [r for r in records if "loss" in r and "step" in r]
    steady = steady_records(steps, profile)
    table_file = run_dir / "profile" / "buckets_rank0.json"
    table = json.loads(table_file.read_text()) if table_file.exists() else None
    step_ms = median_step_ms(steady) if steady else None
    return {
        "steps": steps[-1]["step"] + 1 if steps else 0,  # a record covers train.log_every steps
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
        "mfu": (statistics.median(r["mfu"] for r in steady)
                if steady and steady[0]["mfu"] is not None else None),
        "peak_mem_gib": max(r["mem_mib"] for r in steps) / 1024 if steps else None,
        "step_ms": step_ms,
        "idle_share_steady": (steady_idle_share(table["busy_ms"], step_ms)  # GPU only (kernel time)
                              if table and table["idle_share"] is not None and step_ms else None),
        "profile": None if table is None else {k: table[k] for k in ("wall_ms", "busy_ms", "idle_share",
                                                                      "buckets_ms")},
    }


def compare(config_name: str, trees: dict, args, out_dir: Path) -> dict:
    first, last = args.profile
    extra = ["--set", f"train.profile_steps={first},{last}",
             *(x for o in args.overrides for x in ("--set", o))]
    row: dict = {"config": config_name}
    for label, tree in trees.items():
        own = [x for o in args.this_overrides for x in ("--set", o)] if label == "this" else []
        config = tree / "configs" / config_name
        if not config.exists():
            raise SystemExit(f"bench_ab: {config} does not exist: the {label} tree has no config "
                             f"{config_name}")
        run = run_config(config, args.steps, out_dir / label, [*extra, *own], args.timeout, repo=tree,
                         env={"PYTHONPATH": kernels_path(tree, out_dir / "paths" / label)})
        row[label] = {"passed": run["passed"], "why": run.get("why"), "log_tail": run.get("log_tail"),
                      **summarise(out_dir / label / config.stem, args.profile)}
    base, new = row["baseline"]["tokens_per_s"], row["this"]["tokens_per_s"]
    row["ratio"] = new / base if base and new else None
    return row


def table(rows: list) -> str:
    head = (f"{'config':16s} {'tree':9s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>9s} {'wall ms':>8s} "
            f"{'busy ms':>8s} {'idle':>6s} {'step ms':>8s} {'idle':>6s}")
    lines = [head, "-" * len(head)]

    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    def percent(share):
        return "n/a" if share is None else f"{100 * share:.1f}%"

    for row in rows:
        for label in ("baseline", "this"):
            r, p = row[label], row[label]["profile"] or {}
            lines.append(f"{row['config']:16s} {label:9s} {num(r['tokens_per_s'], '9,.0f')} "
                         f"{percent(r['mfu']):>6s} {num(r['peak_mem_gib'], '9.1f')} "
                         f"{num(p.get('wall_ms'), '8.1f')} {num(p.get('busy_ms'), '8.1f')} "
                         f"{percent(p.get('idle_share')):>6s} {num(r['step_ms'], '8.1f')} "
                         f"{percent(r['idle_share_steady']):>6s}")
        lines.append(f"{row['config']:16s} {'ratio':9s} {num(row['ratio'], '9.3f')}")
    return "\n".join(lines)


def bucket_lines(rows: list) -> list[str]:
    out = []
    for row in rows:
        base, new = row["baseline"]["profile"], row["this"]["profile"]
        if not base or not new:
            continue
        out.append(f"{row['config']}: ms a profiled step, baseline -> this")
        for name in sorted(base["buckets_ms"], key=lambda n: -base["buckets_ms"][n]):
            b, n = base["buckets_ms"][name], new["buckets_ms"].get(name, 0.0)
            if b or n:
                out.append(f"  {name:18s} {b:8.2f} -> {n:8.2f}  ({n - b:+.2f})")
    return out


def plot(rows: list, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r["baseline"]["profile"] and r["this"]["profile"]]
    if not rows:
        return False
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        names = sorted(row["baseline"]["profile"]["buckets_ms"],
                       key=lambda n: -row["baseline"]["profile"]["buckets_ms"][n])
        for offset, label in ((-0.2, "baseline"), (0.2, "this")):
            values = [row[label]["profile"]["buckets_ms"].get(n, 0.0) for n in names]
            ax.barh([i + offset for i in range(len(names))], values, height=0.4, label=label)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("ms a profiled step")
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
        ax.set_title(f"{row['config']} (tokens/s ratio {ratio})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the other source tree (e.g. git archive of a commit)")
    p.add_argument("--configs", required=True, help="comma-separated config file names (configs/<name>)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", default="15,16", help="FIRST,LAST: the profiled steps (train.profile_steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra override for every run (repeatable)")
    p.add_argument("--this-set", dest="this_overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="an override for this tree's runs only (a setting "
                   "measured against the same tree without it: --baseline .; repeatable)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "runs"), "bench_ab"))
    args = p.parse_args(argv)
    try:
        first, last = (int(x) for x in args.profile.split(","))
    except ValueError:
        p.error(f"--profile {args.profile!r}: give FIRST,LAST step numbers, e.g. 15,16")
    if not 2 <= first <= last < args.steps - 1:
        p.error(f"--profile {args.profile}: the window must lie within steps 2..{args.steps - 2} "
                f"(--steps {args.steps}), leaving steady steps around it")
    args.profile = (first, last)
    baseline = Path(args.baseline)
    if not (baseline / "gdn_parallel").is_dir() or not (baseline / "kernels").is_dir():
        p.error(f"--baseline {baseline}: not a source tree of this project (no gdn_parallel/ and kernels/)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through run_config's cleanup
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = {"baseline": baseline.resolve(), "this": REPO}
    rows = []
    for name in (Path(c).name for c in args.configs.split(",") if c):
        rows.append(compare(name, trees, args, out_dir))
        (out_dir / "bench_ab.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
        print(table(rows[-1:]), flush=True)
    print("\n" + table(rows))
    print("\n".join(bucket_lines(rows)))
    if plot(rows, out_dir / "bench_ab.png"):
        print(f"plot: {out_dir / 'bench_ab.png'}")
    return 0 if all(row[label]["passed"] for row in rows for label in ("baseline", "this")) else 1


if __name__ == "__main__":
    sys.exit(main())
