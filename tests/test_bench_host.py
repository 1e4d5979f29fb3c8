"""tools/bench_host.py: the medians over rounds, the py-spy summary by function, and the smoke run
through the tiny config's forward and backward (CPU: the plumbing, not the speed)."""
import json

import pytest
import torch

from tools import bench_host


def test_medians_are_taken_number_by_number_through_nested_rows():
    rounds = [{"forward_host_ms": 3.0, "module_forward_us": {"Block": 10.0, "Attention": 7.0}},
              {"forward_host_ms": 1.0, "module_forward_us": {"Block": 30.0, "Attention": 5.0}},
              {"forward_host_ms": 2.0, "module_forward_us": {"Block": 20.0, "Attention": 9.0}}]
    assert bench_host.median_rows(rounds) == {"forward_host_ms": 2.0,
                                              "module_forward_us": {"Block": 20.0, "Attention": 7.0}}


def test_work_counts_are_the_same_for_the_same_call():
    x = torch.ones(8, requires_grad=True)

    def step():
        (x * 2).sum().backward()

    first = bench_host.work_counts(step, torch.device("cpu"))
    assert first == bench_host.work_counts(step, torch.device("cpu"))
    assert first["kernels"] == 0 and first["aten_ops"] >= 2     # mul and sum at least, and their backward
    assert first["launch_calls"] == 0
    assert sum(c.get("aten_ops", 0) for c in first["by_place"].values()) == first["aten_ops"]
    assert "backward: MulBackward0" in first["by_place"]         # the backward's, by autograd node


def test_spy_summary_counts_each_function_once_per_stack(tmp_path):
    record = tmp_path / "run.spy"
    record.write_text(
        "thread (1): MainThread;run (gdn_parallel/train/trainer.py:10);launch (gdn_kernels/norms.py:5);"
        "launch (gdn_kernels/norms.py:7) 6\n"
        "thread (2);backward (gdn_parallel/ops/projections.py:86);run (triton/runtime/jit.py:743) 3\n"
        "thread (1): MainThread;step (torch/optim/adam.py:1) 1\n")
    summary = bench_host.summarize_spy(record)
    shares = {row["function"]: row["share"] for row in summary["functions"]}
    assert summary["samples"] == 10 and summary["threads"] == {"thread (1): MainThread": 7, "thread (2)": 3}
    assert shares == {"run (gdn_parallel/train/trainer.py)": 0.6, "launch (gdn_kernels/norms.py)": 0.6,
                      "backward (gdn_parallel/ops/projections.py)": 0.3, "run (triton/runtime/jit.py)": 0.3}


def test_smoke_times_every_module_of_the_tiny_config(tmp_path, capsys):
    assert bench_host.main(["--smoke", "--out", str(tmp_path / "host.json")]) == 0
    report = json.loads((tmp_path / "host.json").read_text())
    (row,) = report["configs"]["configs/tiny-cpu.yaml"].values()
    assert row["forward_host_ms"] > 0 and row["backward_host_ms"] > 0
    assert row["step_aten_ops"] > 100 and row["step_kernels"] == 0 and row["step_launch_calls"] == 0
    assert {"HybridLM", "GatedDeltaNet", "Attention", "ShortConvolution"} <= set(row["module_forward_us"])
    # the step's operators by where they come from: the innermost module, or the backward's nodes
    places = row["step_by_place"]
    assert {"GatedDeltaNet", "ShortConvolution", "Attention"} <= set(places)
    assert any(place.startswith("backward: ") for place in places)
    assert sum(c.get("aten_ops", 0) for c in places.values()) == row["step_aten_ops"]
    assert report["launch_us"]["torch add"] > 0
    assert "| GatedDeltaNet |" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--spy"], ["--tokens"]])
def test_arguments_need_values(argv):
    with pytest.raises(SystemExit):
        bench_host.parse_args(argv)
