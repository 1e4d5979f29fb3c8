"""The memory model (train/memory_model.py): its predictions against the peaks measured on the GPU,
and the start-up check that refuses a run that cannot fit, naming settings that would."""
from types import SimpleNamespace

import pytest

from gdn_parallel.config import Config, ConfigError
from gdn_parallel.train import run_setup
from gdn_parallel.train.memory_model import PREDICTION_ERROR, predict_peak, settings_that_fit

LONG = ["train.batch_size=1", "train.microbatch_size=1", "train.activation_checkpointing=full"]

# Peaks the trainer printed (torch.cuda.max_memory_allocated, GiB) for h1-1.3b, one sequence, full
# checkpointing, activation_offload=cpu (docs/benchmarks.md "Memory at long context"): nvidia-h100-x1
# at 32K, 128K, 256K tokens (all blocks offloaded) and nvidia-h200 at 512K (16 of 24 blocks).
MEASURED = [(32768, 0, 23.93), (131072, 0, 37.65), (262144, 0, 56.14), (524288, 16, 109.39)]


def h1(seq_len, *overrides):
    return Config.from_yaml("configs/h1-1.3b.yaml", [*LONG, f"train.seq_len={seq_len}", *overrides])


# The shipped configs as they run (no checkpointing, micro-batches of 4 and 8): the smoke run on
# nvidia-h100-x1 (docs/results/gpu_smoke_h100.json).
SHIPPED = [("gdn-0.4b", 51.6), ("gdn-1.3b", 59.2), ("h1-0.4b", 40.9), ("h1-1.3b", 52.5)]


# The hybrids' configs, the smoke run on nvidia-h200-x2 (one GPU), 2026-11-28: KDA on its Triton kernels.
SHIPPED += [("qwen3next-1.3b", 53.9), ("kimi-1.3b", 69.9)]


@pytest.mark.parametrize("name, measured_gib", SHIPPED)
def test_prediction_of_the_shipped_configs(name, measured_gib):
    predicted = predict_peak(Config.from_yaml(f"configs/{name}.yaml")).peak_gib
    assert abs(predicted / measured_gib - 1) < PREDICTION_ERROR, (name, predicted, measured_gib)


@pytest.mark.parametrize("seq_len, offload_blocks, measured_gib", MEASURED)
def test_prediction_is_within_its_error_of_the_measured_peak(seq_len, offload_blocks, measured_gib):
    config = h1(seq_len, "train.activation_offload=cpu", f"train.activation_offload_blocks={offload_blocks}")
    predicted = predict_peak(config).peak_gib
    assert abs(predicted / measured_gib - 1) < PREDICTION_ERROR, (seq_len, predicted, measured_gib)


def test_kda_counts_the_implementation_that_runs_on_the_gpu():
    """The PyTorch chunk form keeps its decayed products' per-channel terms: configs/kimi-1.3b.yaml with
    model.kda_impl=chunk ran out of an H200's 140 GB at its batch, and is predicted so."""
    kernels = predict_peak(Config.from_yaml("configs/kimi-1.3b.yaml")).peak_gib
    chunk = predict_peak(Config.from_yaml("configs/kimi-1.3b.yaml", ["model.kda_impl=chunk"])).peak_gib
    assert kernels < 80 < 140 < chunk, (kernels, chunk)


def test_offload_moves_block_inputs_to_the_host():
    kept = predict_peak(h1(262144))
    offloaded = predict_peak(h1(262144, "train.activation_offload=cpu"))
    part = predict_peak(h1(262144, "train.activation_offload=cpu", "train.activation_offload_blocks=12"))
    assert offloaded.peak_gib < part.peak_gib < kept.peak_gib
    assert offloaded.offloaded_gib == pytest.approx(24 * 262144 * 2048 * 4 / 2**30)   # fp32 rows
    assert part.offloaded_gib == pytest.approx(offloaded.offloaded_gib / 2)


def test_a_bf16_residual_stream_halves_the_rows_of_the_stream():
    """model.residual_in_fp32=false under bf16: each kept or offloaded block input, the stream's
    gradient and the final norm's input take 2 bytes an element instead of 4."""
    fp32 = predict_peak(h1(262144, "train.activation_offload=cpu"))
    bf16 = predict_peak(h1(262144, "train.activation_offload=cpu", "model.residual_in_fp32=false"))
    assert bf16.offloaded_gib == pytest.approx(fp32.offloaded_gib / 2)
    kept_fp32 = predict_peak(h1(131072))
    kept_bf16 = predict_peak(h1(131072, "model.residual_in_fp32=false"))
    assert kept_bf16.block_inputs_gib == pytest.approx(kept_fp32.block_inputs_gib / 2)
    assert kept_bf16.loss_gib == pytest.approx(kept_fp32.loss_gib * 3 / 4)  # a stream row, an fp32 one
    assert kept_bf16.peak_gib < kept_fp32.peak_gib
    # a float32 run has no autocast: the setting changes nothing
    plain = predict_peak(h1(131072, "train.dtype=float32", "model.residual_in_fp32=false"))
    assert plain.peak_gib == pytest.approx(predict_peak(h1(131072, "train.dtype=float32")).peak_gib)


def test_context_parallelism_divides_the_tokens_not_the_weights():
    one = predict_peak(h1(262144, "train.activation_offload=cpu"))
    two = predict_peak(h1(524288, "train.activation_offload=cpu", "parallel.cp=2"))
    # the same tokens per rank, and FSDP2 replicates weights and optimizer state over cp (HSDP): the
    # same peak as one GPU's
    assert two.working_set_gib == pytest.approx(one.working_set_gib)
    assert two.optimizer_state_gib == pytest.approx(one.optimizer_state_gib)
    assert two.peak_gib == pytest.approx(one.peak_gib)
    # data parallelism under FSDP2 shards them
    sharded = predict_peak(h1(524288, "train.activation_offload=cpu", "parallel.cp=2", "parallel.dp=2"))
    assert sharded.optimizer_state_gib == pytest.approx(one.optimizer_state_gib / 2)


def test_fsdp_accumulates_whole_gradients_on_every_rank():
    """gdn-1.3b's batch of 8 in micro-batches of 4: until the last micro-batch reduces them, FSDP2 adds
    each rank's unsharded fp32 gradients. So dp 2 halves the weights and the optimizer state, not the
    gradients (the model once halved them too: 2.5 GiB under the peak)."""
    one = predict_peak(Config.from_yaml("configs/gdn-1.3b.yaml"))
    two = predict_peak(Config.from_yaml("configs/gdn-1.3b.yaml", ["parallel.dp=2"]))
    assert one.peak_gib - two.peak_gib == pytest.approx((one.weights_gib + one.optimizer_state_gib) / 2)


def test_parameters_kept_gathered_add_the_whole_model_in_the_compute_dtype():
    config = ["parallel.dp=2"]
    sharded = predict_peak(Config.from_yaml("configs/gdn-1.3b.yaml", config))
    kept = predict_peak(Config.from_yaml("configs/gdn-1.3b.yaml",
                                         [*config, "parallel.fsdp_reshard_after_forward=false"]))
    # fp32 weights sharded over 2 ranks, plus a bf16 copy of all of them: 1 + 2 x 2 / 4 = twice the shard
    assert kept.weights_gib == pytest.approx(2 * sharded.weights_gib)
    assert kept.peak_gib - sharded.peak_gib == pytest.approx(sharded.weights_gib)


# Peaks of the long-context configs as shipped, one rank of 2 or 4 (torch.cuda.max_memory_allocated,
# GiB; 4 H200s, 2026-11-26, docs/benchmarks.md "The long-context configs on several GPUs"): the cp
# ranks each hold the whole model, its gradients and optimizer state.
MEASURED_CP = [("h1-1.3b-256k", [], 54.99), ("h1-1.3b-1m", ["train.activation_offload=none"], 93.54),
               ("h1-1.3b-1m", [], 55.26)]


@pytest.mark.parametrize("name, overrides, measured_gib", MEASURED_CP)
def test_prediction_under_context_parallelism(name, overrides, measured_gib):
    predicted = predict_peak(Config.from_yaml(f"configs/{name}.yaml", overrides)).peak_gib
    assert abs(predicted / measured_gib - 1) < PREDICTION_ERROR / 2, (name, predicted, measured_gib)


def test_the_long_context_configs_fit_an_h100():
    for name in ("h1-1.3b-256k", "h1-1.3b-1m"):
        assert predict_peak(Config.from_yaml(f"configs/{name}.yaml")).peak_gib < 79.2 * (1 - PREDICTION_ERROR)


def test_settings_that_fit_name_the_remedies_in_order():
    plain = Config.from_yaml("configs/h1-1.3b.yaml", ["train.batch_size=1", "train.microbatch_size=1",
                                                      "train.seq_len=262144"])
    assert settings_that_fit(plain, 79.2) == ["train.activation_checkpointing=full",
                                              "train.activation_offload=cpu"]
    fits = settings_that_fit(h1(2**21), 79.2)   # 2M tokens: more GPUs per sequence
    assert fits[-1].startswith("parallel.cp=") and "train.activation_offload=cpu" in fits


def fake_gpu(monkeypatch, gib):
    monkeypatch.setattr(run_setup.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(gib * 2**30)))


def test_a_run_that_cannot_fit_is_refused_at_start_up(monkeypatch):
    fake_gpu(monkeypatch, 79.2)
    lines = []
    with pytest.raises(ConfigError, match="with train.activation_offload=cpu it is predicted to fit"):
        run_setup._check_memory(h1(262144), "cuda", lines.append)
    assert lines[0].startswith("mem   | predicted peak")
    run_setup._check_memory(h1(262144, "train.memory_check=false"), "cuda", lines.append)   # only warned
    assert lines[-1].startswith("warning:") and "train.activation_offload=cpu" in lines[-1]
    run_setup._check_memory(h1(262144, "train.activation_offload=cpu"), "cuda", lines.append)
    assert lines[-1].startswith("mem   | predicted peak")


def test_a_run_within_the_prediction_error_is_only_warned_about(monkeypatch):
    config = h1(262144, "train.activation_offload=cpu")
    fake_gpu(monkeypatch, predict_peak(config).peak_gib * (1 - PREDICTION_ERROR / 2))
    lines = []
    run_setup._check_memory(config, "cuda", lines.append)
    assert lines[-1].startswith("warning:")


def test_chunked_recomputation_divides_the_working_set():
    whole = predict_peak(h1(524288, "train.activation_offload=cpu"))
    chunked = predict_peak(h1(524288, "train.activation_offload=cpu", "train.recompute_chunks=8"))
    row = 524288 * 2048 * 4 / 2**30   # the block input's gradient, assembled whole
    assert chunked.working_set_gib == pytest.approx((whole.working_set_gib - 0.14) / 8 + 0.14 + row, rel=0.02)
    plain = Config.from_yaml("configs/h1-1.3b.yaml", ["train.batch_size=1", "train.microbatch_size=1",
                                                      "train.seq_len=524288"])
    assert settings_that_fit(plain, 79.2)[-1].startswith("train.recompute_chunks=")
