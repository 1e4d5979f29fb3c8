"""tools/bench_scaling.py: each dimension keeps each GPU's work, the efficiency is per GPU against the
dimension's one-GPU run, and the smoke run goes through the real trainer under torchrun (CPU gloo)."""
import json

import pytest

from tools import bench_scaling


def _settings(name: str, n: int) -> dict[str, str]:
    return dict(item.split("=", 1) for item in bench_scaling.DIMENSIONS[name].settings(n))


def test_each_dimension_keeps_each_gpus_work():
    # dp: the config's batch of 8 a replica (train.batch_size is per replica: 8n, as first written, gave
    # each GPU n times the work); cp: 64K tokens a rank; tp: the same batch
    assert _settings("dp", 4)["train.batch_size"] == "8" and _settings("dp", 4)["parallel.dp"] == "4"
    assert _settings("dp", 4)["train.microbatch_size"] == "4"
    gathered = _settings("dp-gathered", 2)
    assert gathered.pop("parallel.fsdp_reshard_after_forward") == "false" and gathered == _settings("dp", 2)
    for name, algorithm in (("cp", "relay"), ("cp-allgather", "allgather")):
        at_two = _settings(name, 2)
        assert at_two["train.seq_len"] == str(2 * 65536) and at_two["parallel.cp"] == "2"
        assert at_two["parallel.cp_algorithm"] == algorithm
        assert at_two["train.activation_checkpointing"] == "full"
    assert _settings("tp", 2) == {"parallel.tp": "2"}
    # tp-whole-batch: the batch's 8 rows in one micro-batch from tp 2 on, its one-GPU run tp's own
    assert _settings("tp-whole-batch", 2) == {"parallel.tp": "2", "train.microbatch_size": "8"}
    assert _settings("tp-whole-batch", 1) == _settings("tp", 1)
    assert bench_scaling.DIMENSIONS["tp-whole-batch"].baseline == "tp"


def test_a_dimension_with_a_baseline_shares_its_one_gpu_run():
    tp, whole = bench_scaling.DIMENSIONS["tp"], bench_scaling.DIMENSIONS["tp-whole-batch"]
    assert not bench_scaling._baseline_measured(whole, [])        # asked alone: it runs its own
    assert bench_scaling._baseline_measured(whole, [{"dimension": "tp", "gpus": 1}])
    assert not bench_scaling._baseline_measured(tp, [{"dimension": "tp", "gpus": 1}])
    rows = [{"dimension": "tp", "gpus": 1, "tokens_per_s": 50.0},
            {"dimension": "tp-whole-batch", "gpus": 2, "tokens_per_s": 90.0, "baseline": "tp"}]
    bench_scaling.efficiencies(rows)
    assert rows[1]["efficiency"] == 0.9
    alone = [{"dimension": "tp-whole-batch", "gpus": n, "tokens_per_s": s, "baseline": "tp"}
             for n, s in ((1, 40.0), (2, 60.0))]
    bench_scaling.efficiencies(alone)
    assert [r["efficiency"] for r in alone] == [1.0, 0.75]


def test_efficiency_is_per_gpu_against_the_dimensions_one_gpu_run():
    rows = [{"dimension": "dp", "gpus": 1, "tokens_per_s": 100.0},
            {"dimension": "dp", "gpus": 4, "tokens_per_s": 360.0},
            {"dimension": "tp", "gpus": 1, "tokens_per_s": 50.0},
            {"dimension": "tp", "gpus": 2, "tokens_per_s": None}]   # a failed run has no efficiency
    bench_scaling.efficiencies(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.9, 1.0, None]
    assert rows[1]["tokens_per_s_per_gpu"] == 90.0


def test_steps_must_outlast_the_skipped_ones():
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--steps", "3", "--skip", "3"])
    with pytest.raises(SystemExit):   # logging every 10 steps: the interval after step 4 starts at 10
        bench_scaling.parse_args(["--steps", "10", "--skip", "4", "--log-every", "10"])
    assert bench_scaling.parse_args(["--steps", "11", "--skip", "4"]).log_every == 10


def test_speed_is_the_median_of_the_intervals_after_the_skipped_steps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 9, "interval_steps": 10, "tokens_per_s": 10.0, "loss": 9.0},    # holds steps 0-9
               {"step": 19, "interval_steps": 10, "tokens_per_s": 100.0, "loss": 5.0},
               {"step": 29, "interval_steps": 10, "tokens_per_s": 120.0, "loss": 4.0},
               {"step": 39, "interval_steps": 10, "tokens_per_s": 90.0, "loss": 3.0}]
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    speed = bench_scaling._speed(metrics, skip=4)
    assert speed["tokens_per_s"] == 100.0 and speed["steps_measured"] == 30 and speed["intervals"] == 3
    assert speed["first_loss"] == 9.0 and speed["loss_fell"]


@pytest.mark.integration
def test_smoke_runs_the_trainer_and_writes_table_json_and_plot(tmp_path, capsys):
    status = bench_scaling.main(["--smoke", "--dims", "cp", "--steps", "4", "--skip", "2",
                                 "--out", str(tmp_path)])
    report = json.loads((tmp_path / "scaling.json").read_text())
    rows = {(r["dimension"], r["gpus"]): r for r in report["rows"]}
    assert status == 0, [r["status"] for r in report["rows"]]
    assert set(rows) == {("cp", 1), ("cp", 2)}
    assert rows[("cp", 2)]["tokens_per_s"] > 0 and rows[("cp", 2)]["loss_fell"]
    command = rows[("cp", 2)]["command"]
    assert "torch.distributed.run" in command and "parallel.cp=2" in command
    assert rows[("cp", 1)]["efficiency"] == 1.0 and rows[("cp", 2)]["efficiency"] > 0
    assert "| cp | 2 |" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_rows_past_the_budget_are_listed_as_not_run_and_each_row_is_kept_as_it_ends(tmp_path, monkeypatch):
    """A device call can stop the tool: scaling.json holds every finished row after each one, and the
    rows --budget-s leaves no time for are named, not dropped."""
    seen = []

    def fake_row(dim, n, args, extra):
        seen.append(json.loads((tmp_path / "scaling.json").read_text())["rows"] if seen else [])
        monkeypatch.setattr(bench_scaling.time, "monotonic", lambda: 1e9)   # the budget is spent now
        return {"dimension": dim.name, "gpus": n, "status": 0, "tokens_per_s": 10.0, "loss_fell": True}

    monkeypatch.setattr(bench_scaling, "measure_row", fake_row)
    status = bench_scaling.main(["--smoke", "--dims", "dp", "--budget-s", "60", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert status == 1 and len(seen) == 1
    assert [r["status"] for r in rows] == [0, "not run: --budget-s 60 spent"]
