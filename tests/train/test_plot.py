"""tools/plot.py draws one PNG from synthetic metrics.jsonl files, with and without evaluations."""
import json

import pytest

from gdn_parallel.train.metrics_sinks import read_metrics as read_records
from tools.plot import main, run_labels

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(directory, steps=range(0, 50, 10), val=False, mfu=None, resume_at=None):
    directory.mkdir(parents=True)
    records = []
    for step in steps:
        records.append({"step": step, "loss": 5.0 - step / 20, "lr": 1e-3, "grad_norm": 1.0,
                        "tokens_per_s": 1000.0 + step, "mfu": mfu, "mem_mib": 500.0 + step,
                        "eta_s": 1.0, "tokens": 64 * (step + 1), "interval_s": 0.1, "interval_steps": 10})
        if val and step % 20 == 0:
            records.append({"step": step, "val_loss": 5.1 - step / 20,
                            "val_loss_by_position": {"0-64": 5.3 - step / 20, "64-256": 5.0 - step / 20}})
    if resume_at is not None:
        records.append({"step": resume_at, "resumed": True})
        records.append({"step": resume_at, "loss": 1.0, "tokens_per_s": 900.0, "mfu": mfu, "mem_mib": 1.0})
    records.append({"step": steps[-1], "summary": {"final_loss": 3.0}})
    path = directory / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 99, "lo')  # a torn tail
    return path


def test_plot_without_evaluations(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "plain")
    out = tmp_path / "out" / "plain.png"
    assert main([str(tmp_path / "plain"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_overlays_runs_with_val_and_positions(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "a", val=True, mfu=0.31)
    write_run(tmp_path / "b", steps=range(0, 30, 10), val=True, resume_at=20)   # given as its directory
    out = tmp_path / "both.png"
    assert main([str(a), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000


def test_records_after_a_resume_replace_the_lost_ones(tmp_path):
    path = write_run(tmp_path / "run", steps=range(0, 40, 10), resume_at=20)
    steps = [(r["step"], r.get("loss")) for r in read_records(path) if "summary" not in r]
    assert steps == [(0, 5.0), (10, 4.5), (20, None), (20, 1.0)]   # steps 20 and 30 of before are gone


def test_runs_are_labelled_by_directory(tmp_path):
    paths = [tmp_path / "x" / "run1" / "metrics.jsonl", tmp_path / "y" / "run1" / "metrics.jsonl",
             tmp_path / "run2" / "metrics.jsonl"]
    assert run_labels(paths) == [str(tmp_path / "x" / "run1"), str(tmp_path / "y" / "run1"), "run2"]


def test_a_missing_run_is_named(tmp_path):
    with pytest.raises(SystemExit, match="nowhere"):
        main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")])
