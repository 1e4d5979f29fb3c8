"""Plot training runs from their metrics.jsonl to one PNG, several runs overlaid, each labelled by its
directory (console script `gdn-plot`; `python3 tools/plot.py` runs the same).

    gdn-plot runs/a runs/b/metrics.jsonl --out curves.png

Panels: loss (train lines, val markers), throughput (tokens/s), MFU (%), memory (MiB) and, when a run
has evaluated by position, the loss of its last evaluation per position bucket. Needs matplotlib.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .metrics_sinks import METRICS_FILE, read_metrics  # read_metrics: resume markers, torn lines

PROG = "gdn-plot"
Series = list[tuple[int, float]]


def metrics_path(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise SystemExit(f"{PROG}: {run!r} is neither a {METRICS_FILE} nor a directory holding one")
    return path


def run_labels(paths: list[Path]) -> list[str]:
    """Each run's directory name; the whole directory path where two names would be the same."""
    names = [p.resolve().parent.name for p in paths]
    return [name if names.count(name) == 1 else str(p.parent) for name, p in zip(names, paths)]


def series(records: list[dict], field: str, scale: float = 1.0) -> Series:
    return [(r["step"], r[field] * scale) for r in records
            if isinstance(r.get(field), (int, float)) and "step" in r]


def last_by_position(records: list[dict]) -> tuple[int, dict[str, float]] | None:
    """(step, {bucket: loss}) of the last evaluation by position, if any."""
    for record in reversed(records):
        if record.get("val_loss_by_position"):
            return record["step"], record["val_loss_by_position"]
    return None


def bucket_start(bucket: str) -> float:
    try:
        return float(bucket.split("-")[0])
    except ValueError:
        return float("inf")


def plot_runs(paths: list[Path], out: Path) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"{PROG} needs matplotlib: pip install matplotlib") from None
    runs = [(label, read_metrics(path)) for label, path in zip(run_labels(paths), paths)]
    by_position = [(label, last_by_position(records)) for label, records in runs]
    by_position = [(label, found) for label, found in by_position if found is not None]
    panels = ["loss", "tokens/s", "MFU (%)", "memory (MiB)"] + (["position"] if by_position else [])
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.6 * rows), squeeze=False)
    axes = dict(zip(panels, axes.flat))
    for unused in list(fig.axes)[len(panels):]:
        unused.set_visible(False)

    for index, (label, records) in enumerate(runs):
        color = f"C{index % 10}"
        _line(axes["loss"], series(records, "loss"), color, f"{label} train")
        _line(axes["loss"], series(records, "val_loss"), color, f"{label} val", style="o--")
        _line(axes["tokens/s"], series(records, "tokens_per_s"), color, label)
        _line(axes["MFU (%)"], series(records, "mfu", 100.0), color, label)
        _line(axes["memory (MiB)"], series(records, "mem_mib"), color, label)
    if not axes["MFU (%)"].lines:
        axes["MFU (%)"].text(0.5, 0.5, "n/a: no peak FLOP/s known (train.peak_tflops)",
                             ha="center", va="center", transform=axes["MFU (%)"].transAxes)
    for name in ("loss", "tokens/s", "MFU (%)", "memory (MiB)"):
        ax = axes[name]
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)" if name == "loss" else name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if by_position:
        _plot_by_position(axes["position"], by_position, [label for label, _ in runs])

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _line(ax, points: Series, color: str, label: str, style: str = "-") -> None:
    if points:
        ax.plot(*zip(*points), style, color=color, label=label, lw=1.0, ms=4)


def _plot_by_position(ax, by_position, labels: list[str]) -> None:
    buckets = sorted({b for _, (_, losses) in by_position for b in losses}, key=bucket_start)
    for label, (step, losses) in by_position:
        color = f"C{labels.index(label) % 10}"
        points = [(buckets.index(b), loss) for b, loss in losses.items()]
        ax.plot(*zip(*sorted(points)), "o-", color=color, label=f"{label} (step {step})")
    ax.set_xticks(range(len(buckets)), buckets, rotation=30, fontsize=8)
    ax.set_xlabel("token position in its document")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("val loss by position, last evaluation", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help=f"{METRICS_FILE} files or the run directories holding them")
    parser.add_argument("--out", default="metrics.png", help="the PNG to write (default: metrics.png)")
    args = parser.parse_args(argv)
    out = plot_runs([metrics_path(run) for run in args.runs], Path(args.out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
