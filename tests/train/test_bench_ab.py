"""tools/bench_ab.py: two source trees' trainers side by side (here this tree twice, on CPU), the
steady tokens/s outside the profiled window, the profile tables and the ratio; bad arguments named."""
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import bench_ab  # noqa: E402

SMALL = ["model.n_layers=2", "train.seq_len=64", "train.batch_size=2", "train.microbatch_size=2"]


def test_both_trees_train_and_are_compared(tmp_path, capsys):
    # Logging every 3 steps as the configs log every 10: records at 0, 3, 6, 9; only 9's interval
    # (7-9) is steady, and the run is whole though it has 4 records for its 10 steps.
    args = ["--baseline", str(REPO), "--configs", "configs/tiny-cpu.yaml", "--steps", "10",
            "--profile", "3,3", "--timeout", "300", "--out", str(tmp_path),
            *(x for o in SMALL for x in ("--set", o)), "--set", "train.log_every=3",
            "--this-set", "model.residual_in_fp32=false"]
    assert bench_ab.main(args) == 0, capsys.readouterr().out[-3000:]
    row = json.loads((tmp_path / "bench_ab.json").read_text())["rows"][0]
    for label in ("baseline", "this"):
        run = row[label]
        assert run["passed"] and run["steps"] == 10 and run["tokens_per_s"] > 0
        assert set(run["profile"]) == {"wall_ms", "busy_ms", "idle_share", "buckets_ms"}
        assert run["step_ms"] > 0 and run["idle_share_steady"] is None  # no GPU kernels on the CPU
        # each tree ran its own kernels from its own path folder
        assert (tmp_path / "paths" / label / "gdn_kernels").resolve() == REPO / "kernels"
        # --this-set reaches this tree's run only
        ran = yaml.safe_load((tmp_path / label / "tiny-cpu" / "config.yaml").read_text())
        assert ran["model"]["residual_in_fp32"] is (label == "baseline")
    assert row["ratio"] == pytest.approx(row["this"]["tokens_per_s"] / row["baseline"]["tokens_per_s"])
    out = capsys.readouterr().out
    assert "ratio" in out and "baseline -> this" in out


def test_steady_steps_leave_out_warmup_and_the_profiled_window(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rates = {0: 1.0, 1: 2.0, 2: 100.0, 3: 5.0, 4: 6.0, 5: 100.0, 6: 100.0}  # 3 profiled, 4 after it
    run.joinpath("metrics.jsonl").write_text("\n".join(
        json.dumps({"step": s, "loss": 1.0, "tokens_per_s": r, "mfu": None, "mem_mib": 1024.0 * s,
                    "interval_s": 1 / r, "interval_steps": 1})  # one token a step
        for s, r in rates.items()))
    summary = bench_ab.summarise(run, (3, 3))
    assert summary["tokens_per_s"] == 100.0 and summary["peak_mem_gib"] == 6.0 and summary["profile"] is None
    assert summary["step_ms"] == pytest.approx(10.0)
    with run.joinpath("metrics.jsonl").open("a") as fh:  # a run killed on its timeout mid-write
        fh.write('\n{"step": 7, "loss": 1.0, "tok')
    assert bench_ab.summarise(run, (3, 3)) == summary


def test_a_logged_interval_counts_only_where_all_its_steps_are_steady():
    """train.log_every=10 over 40 steps, profiled at 35-36: the lines at 0, 10, 20, 30, 39 cover
    0, 1-10, 11-20, 21-30 and 31-39; only 11-20 and 21-30 hold neither a warm-up nor a profiled step."""
    records = [{"step": s, "tokens_per_s": float(s)} for s in (0, 10, 20, 30, 39)]
    assert [r["step"] for r in bench_ab.steady_records(records, (35, 36))] == [20, 30]
    every_step = [{"step": s} for s in range(8)]
    assert [r["step"] for r in bench_ab.steady_records(every_step, (3, 3))] == [2, 5, 6, 7]


@pytest.mark.parametrize("extra, message", [
    (["--profile", "1,2"], "within steps 2..18"), (["--profile", "x"], "FIRST,LAST"),
    (["--baseline", "configs"], "not a source tree")])
def test_bad_arguments_are_named(extra, message, capsys):
    argv = ["--baseline", str(REPO), "--configs", "configs/tiny-cpu.yaml", *extra]
    with pytest.raises(SystemExit):
        bench_ab.main(argv)
    assert message in capsys.readouterr().err
