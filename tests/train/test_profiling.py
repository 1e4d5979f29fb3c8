"""train.profile_steps (issue 26): the steps it names run under torch.profiler; a chrome trace and the
table of where their time went are written under <out_dir>/profile/ and the table is printed."""
import json

import pytest

from gdn_parallel.config import Config, ConfigError, parse_profile_steps
from gdn_parallel.train import run_training
from gdn_parallel.train.metrics_sinks import read_metrics
from gdn_parallel.train.profiling import BUCKETS, _union_ms, bucket_of, steady_idle_share

SMALL = ["model.n_layers=2", "train.seq_len=64", "train.batch_size=2", "train.eval_every=0",
         "train.log_every=1", "checkpoint.enabled=false"]


def test_the_named_steps_are_profiled_into_a_trace_and_a_table(tmp_path):
    lines = []
    config = Config.from_yaml("configs/tiny-cpu.yaml", SMALL + [
        "train.steps=5", "train.warmup_steps=1", f"train.out_dir={tmp_path}", "train.profile_steps=1,2"])
    run_training(config, print_fn=lines.append)
    table = json.loads((tmp_path / "profile" / "buckets_rank0.json").read_text())
    assert table["steps"] == [1, 2] and set(table["buckets_ms"]) == set(BUCKETS)
    assert table["wall_ms"] > 0 and 0 < table["busy_ms"]
    assert table["buckets_ms"]["matmul"] > 0 and table["top"]
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    said = [line for line in lines if line.startswith("profile |")]
    assert "steps 1-2" in said[0] and any("matmul" in line for line in said[1:])


@pytest.mark.parametrize("value, message", [
    ("10-12", "FIRST,LAST"), ("3,1", "before its first"), ("1,2,3", "FIRST,LAST"), ("2,9", "steps are 0..4")])
def test_a_bad_window_names_the_field(value, message):
    settings = SMALL + ["train.steps=5", "train.warmup_steps=1", f"train.profile_steps={value}"]
    config = Config.from_yaml("configs/tiny-cpu.yaml", settings, validate=False)
    with pytest.raises(ConfigError, match=f"train.profile_steps=.*{message}"):
        config.validate()


def test_windows_parse():
    assert parse_profile_steps("") is None and parse_profile_steps(" 10 , 12 ") == (10, 12)
    assert parse_profile_steps("7") == (7, 7)


@pytest.mark.parametrize("name, bucket", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", "matmul"),
    ("output_forward", "GDN kernels"), ("qkw_backward", "GDN kernels"), ("_gate_bwd", "GDN kernels"),
    ("_l2norm_rows_fwd", "GDN kernels"),
    ("_norm_bwd", "conv + norm"), ("_conv_fwd_kernel", "conv + norm"),
    ("_row_stats_kernel", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "casts + copies"),
    ("triton_poi_fused_add_mul_0", "other elementwise"),
])
def test_kernels_fall_into_their_buckets(name, bucket):
    assert bucket_of(name) == bucket


def test_busy_time_is_the_union_of_kernel_intervals():
    assert _union_ms([(0, 1000), (500, 1500), (3000, 3500), (3100, 3200)]) == pytest.approx(2.0)
    assert _union_ms([]) == 0.0


def test_the_steady_idle_share_is_busy_time_against_the_unprofiled_step():
    assert steady_idle_share(90.0, 100.0) == pytest.approx(0.1)
    assert steady_idle_share(105.0, 100.0) == 0.0  # a profiled step's kernels ran slower than a steady step


def test_bench_train_times_the_trainer_as_users_run_it(tmp_path):
    """tools/bench_train.py --trainer: the trainer's own process and steps, its profile beside them."""
    from tools.bench_train import trainer_row
    # Lines at 0, 2, 4, 6, 8, 9 (every 2 steps), the profiler from step 5: only the lines at 4 (steps 3-4)
    # and 9 are steady.
    row = trainer_row("configs/tiny-cpu.yaml", 10, str(tmp_path / "bench.json"), ("train.log_every=2",))
    assert "error" not in row, row.get("error")
    assert row["model"] == "trainer train.log_every=2" and row["batch"] == 4 and row["tokens_per_s"] > 0
    assert row["peak_gib"] > 0 and set(row["buckets_ms"]) == set(BUCKETS)
    assert row["step_ms"] > 0 and row["idle_share_steady"] is None  # the CPU has no kernel time
    assert "train.profile_steps=6,7" in row["command"] and "train.log_every=2" in row["command"]
    run_dir = tmp_path / "bench_trainer" / "tiny-cpu-train_log_every_2"
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in r]
    steady = [r["tokens_per_s"] for r in lines if r["step"] in (4, 9)]
    assert row["tokens_per_s"] == pytest.approx(sum(steady) / 2)  # the median of two
    with pytest.raises(SystemExit, match="logs every 10 steps, so give at least 25"):
        trainer_row("configs/tiny-cpu.yaml", 24, str(tmp_path / "bench.json"))


def test_a_run_stopped_inside_the_window_writes_the_steps_it_profiled(tmp_path):
    """close() (the trainer's end of run) writes what the profiler saw, counted by the steps run."""
    import torch

    from gdn_parallel.train.profiling import StepProfiler
    lines = []
    profiler = StepProfiler((1, 4), str(tmp_path), 0, torch.device("cpu"), lines.append)
    for step in range(3):  # stopped after step 2: steps 1 and 2 profiled
        with profiler.around(step):
            torch.randn(64, 64) @ torch.randn(64, 64)
    profiler.close()
    table = json.loads((tmp_path / "profile" / "buckets_rank0.json").read_text())
    assert table["steps"] == [1, 2] and "steps 1-2" in lines[0]
    profiler.close()  # nothing left to write
    assert len([line for line in lines if "steps 1-2" in line]) == 1


def test_the_step_before_the_window_warms_the_profiler_up_and_is_not_recorded(tmp_path):
    """The profiler starts a step early (its own start-up, CUPTI on a GPU, lands there and would
    otherwise count as idle time); only the named steps are in the trace and the table."""
    import torch

    from gdn_parallel.train.profiling import StepProfiler
    lines = []
    profiler = StepProfiler((2, 3), str(tmp_path), 0, torch.device("cpu"), lines.append)
    for step in range(5):
        with profiler.around(step), torch.profiler.record_function(f"marker_of_step_{step}"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    profiler.close()
    names = {event.get("name") for event in
             json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())["traceEvents"]}
    assert {"marker_of_step_2", "marker_of_step_3"} <= names
    assert not names & {"marker_of_step_0", "marker_of_step_1", "marker_of_step_4"}
    assert json.loads((tmp_path / "profile" / "buckets_rank0.json").read_text())["steps"] == [2, 3]


def test_gpu_busy_time_counts_kernels_not_the_annotations_on_the_gpu_timeline():
    """ProfilerStep#N and record_function ranges appear on the GPU's timeline as user annotations
    spanning their kernels: counted, they made a step look 99.7% busy whatever its gaps."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from gdn_parallel.train.profiling import bucket_table

    def event(name, start_us, end_us, annotation=False):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start_us, end=end_us,
                                                          elapsed_us=lambda: end_us - start_us))
    events = [event("ProfilerStep#7", 0, 10_000, annotation=True),
              event("Optimizer.step#AdamW.step", 6_000, 9_000, annotation=True),
              event("nvjet_sm90_gemm", 0, 4_000), event("_norm_bwd", 5_000, 6_000)]
    table = bucket_table(SimpleNamespace(events=lambda: events), wall_ms=10.0, steps=1, on_gpu=True)
    assert table["busy_ms"] == 5.0 and abs(table["idle_share"] - 0.5) < 1e-12
    assert table["buckets_ms"]["matmul"] == 4.0 and table["buckets_ms"]["conv + norm"] == 1.0
    assert table["buckets_ms"]["optimizer"] == 0.0 and table["buckets_ms"]["other elementwise"] == 0.0


def test_a_run_resumed_inside_the_window_profiles_the_steps_it_runs(tmp_path):
    """No warm-up step before a resumed run's first step: the window's remaining steps are profiled."""
    import torch

    from gdn_parallel.train.profiling import StepProfiler
    lines = []
    profiler = StepProfiler((2, 4), str(tmp_path), 0, torch.device("cpu"), lines.append)
    for step in range(3, 6):  # resumed at step 3
        with profiler.around(step), torch.profiler.record_function(f"marker_of_step_{step}"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    profiler.close()
    names = {event.get("name") for event in
             json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())["traceEvents"]}
    assert {"marker_of_step_3", "marker_of_step_4"} <= names and "marker_of_step_5" not in names
    assert json.loads((tmp_path / "profile" / "buckets_rank0.json").read_text())["steps"] == [3, 4]


def test_the_window_is_split_step_by_step(tmp_path):
    """One window, each step on its own (per_step): a slow step shows apart from a fast one."""
    import torch

    from gdn_parallel.train.profiling import StepProfiler
    lines = []
    profiler = StepProfiler((1, 2), str(tmp_path), 0, torch.device("cpu"), lines.append)
    a = torch.randn(256, 256)
    for step in range(3):
        with profiler.around(step):
            for _ in range(40 if step == 1 else 1):   # step 1 does 40 times step 2's products
                a @ a
    profiler.close()
    table = json.loads((tmp_path / "profile" / "buckets_rank0.json").read_text())
    slow, fast = table["per_step"]
    assert slow["buckets_ms"]["matmul"] > 5 * fast["buckets_ms"]["matmul"] > 0
    assert slow["wall_ms"] > fast["wall_ms"] > 0 and slow["top"][0]["name"].startswith("aten::")
    assert any(line.startswith("profile | step 1: ") for line in lines)
    assert any(line.startswith("profile | step 2: ") for line in lines)


def test_a_gpu_window_is_split_by_the_host_step_spans_with_what_the_host_did():
    """Kernels go to the step whose host span (ProfilerStep) they start in; each step's GPU idle share
    and the host's own operators beside it (a host stall shows as idle GPU time)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from gdn_parallel.train.profiling import split_by_step

    def event(name, start_us, end_us, device=DeviceType.CUDA, own_us=0):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=False,
                               self_cpu_time_total=own_us,
                               time_range=SimpleNamespace(start=start_us, end=end_us,
                                                          elapsed_us=lambda: end_us - start_us))
    cpu = DeviceType.CPU
    events = [event("ProfilerStep*", 0, 10_000, cpu), event("ProfilerStep*", 10_000, 30_000, cpu),
              event("nvjet_sm90_gemm", 1_000, 9_000), event("nvjet_sm90_gemm", 11_000, 15_000),
              event("state_forward", 15_000, 17_000),
              event("aten::mm", 500, 600, cpu, own_us=100),
              event("cudaStreamSynchronize", 17_000, 29_000, cpu, own_us=12_000)]
    first, second = split_by_step(events, on_gpu=True)
    assert first["wall_ms"] == 10.0 and first["busy_ms"] == 8.0 and first["buckets_ms"] == {"matmul": 8.0}
    assert second["wall_ms"] == 20.0 and second["busy_ms"] == 6.0 and abs(second["idle_share"] - 0.7) < 1e-12
    assert second["buckets_ms"] == {"matmul": 4.0, "GDN kernels": 2.0}
    assert second["host_top"][0] == {"name": "cudaStreamSynchronize", "ms": 12.0}
    assert first["host_top"] == [{"name": "aten::mm", "ms": 0.1}]
