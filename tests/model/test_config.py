"""Config: YAML round trip, overrides, validation naming the field."""
import os
from pathlib import Path

import pytest

from gdn_parallel.config import Config, ConfigError, ModelConfig, TrainConfig
from gdn_parallel.model import MIXERS, check_kernels, check_layers
from gdn_parallel.ops.triton_dispatch import kernel_module
from tools.count_params import count_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny-cpu.yaml"


def test_yaml_round_trip(tmp_path):
    config = Config.from_yaml(CONFIGS / "tiny-cpu.yaml")
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml())
    assert Config.from_yaml(path) == config


def test_overrides_are_typed_and_validated():
    config = Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["train.lr=1e-4", "model.layer_pattern=GGS",
                                                        "model.n_layers=3"])
    assert config.train.lr == 1e-4 and config.model.layer_types == "GGS"
    with pytest.raises(ConfigError, match="no field 'nope'"):
        Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["train.nope=1"])
    with pytest.raises(ConfigError, match="train.steps"):
        Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["train.steps=0"])
    with pytest.raises(ConfigError, match="must be an integer"):
        Config.from_yaml(CONFIGS / "tiny-cpu.yaml", ["model.hidden_size=1.5"])


def test_unknown_yaml_field_and_missing_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError, match="model.hiden_size"):
        Config.from_yaml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name,billions", [("gdn-0.4b", 0.4), ("h1-0.4b", 0.4), ("gdn-1.3b", 1.3),
                                           ("h1-1.3b", 1.3)])
def test_paper_scale_configs_match_their_names(name, billions):
    total = count_parameters(str(CONFIGS / f"{name}.yaml"))["total"]
    assert abs(total / 1e9 - billions) / billions < 0.05, total


def test_every_config_file_and_the_defaults_validate():
    for path in sorted(CONFIGS.glob("*.yaml")):
        Config.from_yaml(path)
    Config().validate()


# (overrides on configs/tiny-cpu.yaml, the field the error must name). At least one row per field of
# every section (test_bad_inputs_cover_every_field), plus the cross-field rules.
BAD_INPUTS = [
    # model
    ("model.vocab_size=0", "model.vocab_size"),
    ("model.hidden_size=0", "model.hidden_size"),
    ("model.hidden_size=1.5", "model.hidden_size"),
    ("model.n_layers=0", "model.n_layers"),
    ("model.layer_pattern=GX", "model.layer_pattern"),
    ("model.layer_pattern=''", "model.layer_pattern"),
    ("model.layer_pattern=GSG", "model.layer_pattern"),       # does not tile 4 layers
    ("model.gdn_num_heads=0", "model.gdn_num_heads"),
    ("model.gdn_num_v_heads=0", "model.gdn_num_v_heads"),
    ("model.gdn_num_v_heads=3", "model.gdn_num_v_heads"),
    ("model.gdn_head_dim=0", "model.gdn_head_dim"),
    ("model.gdn_head_dim=512", "model.gdn_head_dim"),
    ("model.gdn_expand_v=-1", "model.gdn_expand_v"),
    ("model.gdn_expand_v=0", "model.gdn_expand_v"),
    ("model.gdn_expand_v=0.01", "model.gdn_expand_v"),        # a value head of 0.32
    ("model.gdn_expand_v=16", "model.gdn_expand_v"),          # 512 > the kernels' 256
    ("model.gdn_use_gate=2", "model.gdn_use_gate"),
    ("model.gdn_allow_neg_eigval=maybe", "model.gdn_allow_neg_eigval"),
    ("model.gdn_chunk_size=48", "model.gdn_chunk_size"),
    ("model.gdn_chunk_size=0", "model.gdn_chunk_size"),
    ("model.gdn_impl=fast", "model.gdn_impl"),
    ("model.kda_num_heads=0", "model.kda_num_heads"),
    ("model.kda_num_v_heads=0", "model.kda_num_v_heads"),
    ("model.kda_num_v_heads=3", "model.kda_num_v_heads"),      # not a multiple of 2 q/k heads
    ("model.kda_head_dim=0", "model.kda_head_dim"),
    ("model.kda_head_dim=512", "model.kda_head_dim"),
    ("model.kda_expand_v=0", "model.kda_expand_v"),
    ("model.kda_expand_v=0.01", "model.kda_expand_v"),        # a value head of 0.32
    ("model.kda_expand_v=16", "model.kda_expand_v"),          # 512 > 256
    ("model.kda_allow_neg_eigval=maybe", "model.kda_allow_neg_eigval"),
    ("model.kda_chunk_size=48", "model.kda_chunk_size"),
    ("model.kda_impl=fused", "model.kda_impl"),
    ("model.conv_size=0", "model.conv_size"),
    ("model.conv_size=1000", "model.conv_size"),
    ("model.conv_bias=2", "model.conv_bias"),
    ("model.attn_num_heads=0", "model.attn_num_heads"),
    ("model.attn_num_heads=3", "model.attn_num_heads"),       # 128 is not divisible by 3
    ("model.attn_num_kv_heads=0", "model.attn_num_kv_heads"),
    ("model.attn_num_kv_heads=3", "model.attn_num_kv_heads"),
    ("model.attn_head_dim=0", "model.attn_head_dim"),
    ("model.attn_head_dim=7", "model.attn_head_dim"),         # odd: no RoPE pairs
    ("model.window_size=0", "model.window_size"),
    ("model.rope_theta=0", "model.rope_theta"),
    ("model.rope_theta=-1", "model.rope_theta"),
    ("model.attn_output_gate=2", "model.attn_output_gate"),
    ("model.attn_qkv_bias=2", "model.attn_qkv_bias"),
    ("model.attn_qk_norm=2", "model.attn_qk_norm"),
    ("model.attn_rotary_dim=-2", "model.attn_rotary_dim"),
    ("model.attn_rotary_dim=3", "model.attn_rotary_dim"),      # odd: RoPE rotates pairs
    ("model.attn_impl=fast", "model.attn_impl"),
    ("model.hidden_ratio=0", "model.hidden_ratio"),
    ("model.hidden_ratio=0.001", "model.hidden_ratio"),       # an MLP width of 0
    ("model.intermediate_size=0", "model.intermediate_size"),
    ("model.norm_eps=-1", "model.norm_eps"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("model.tie_word_embeddings=2", "model.tie_word_embeddings"),
    ("model.residual_in_fp32=maybe", "model.residual_in_fp32"),
    ("model.initializer_range=-1", "model.initializer_range"),
    ("model.initializer_range=0", "model.initializer_range"),
    ("model.fused_linear_cross_entropy=2", "model.fused_linear_cross_entropy"),
    # data
    ("data.source=''", "data.source"),
    ("data.source=3", "data.source"),
    ("data.val_fraction=1.0", "data.val_fraction"),
    ("data.val_fraction=-0.1", "data.val_fraction"),
    ("data.seed=1.5", "data.seed"),
    (f"data.seed={2 ** 64}", "data.seed"),
    # train
    ("train.seq_len=1", "train.seq_len"),                     # no label token
    (["train.seq_len=1", "parallel.cp=2"], "train.seq_len"),
    ("train.seq_len=0", "train.seq_len"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.microbatch_size=-1", "train.microbatch_size"),
    ("train.microbatch_size=3", "train.microbatch_size"),     # does not divide 4 sequences
    ("train.steps=0", "train.steps"),
    ("train.lr=0", "train.lr"),
    ("train.lr=-1", "train.lr"),
    ("train.lr=.nan", "train.lr"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio"),
    ("train.warmup_steps=-1", "train.warmup_steps"),
    ("train.warmup_steps=300", "train.warmup_steps"),         # more than the 200 steps
    ("train.weight_decay=-5", "train.weight_decay"),
    ("train.beta1=1.5", "train.beta1"),
    ("train.beta1=1.0", "train.beta1"),
    ("train.beta2=-0.1", "train.beta2"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.grad_clip=.inf", "train.grad_clip"),
    (f"train.seed={2 ** 64}", "train.seed"),
    ("train.log_every=0", "train.log_every"),
    ("train.eval_every=-3", "train.eval_every"),
    ("train.eval_rows=0", "train.eval_rows"),
    ("train.device=gpu", "train.device"),
    ("train.device=cuda:x", "train.device"),
    ("train.dtype=fp8", "train.dtype"),
    ("train.threads=-4", "train.threads"),
    ("train.out_dir=3", "train.out_dir"),
    ("train.peak_tflops=-1", "train.peak_tflops"),
    ("train.activation_checkpointing=blocks", "train.activation_checkpointing"),
    ("train.activation_offload=nvme", "train.activation_offload"),
    ("train.activation_offload=cpu", "train.activation_checkpointing=full"),  # needs full checkpointing
    ("train.activation_offload_blocks=-1", "train.activation_offload_blocks"),
    ("train.memory_check=maybe", "train.memory_check"),
    ("train.recompute_chunks=0", "train.recompute_chunks"),
    ("train.recompute_chunks=2", "train.activation_checkpointing=full"),  # needs full checkpointing
    ("train.lr_schedule=linear", "train.lr_schedule"),
    ("train.decay_fraction=0", "train.decay_fraction"),
    ("train.decay_fraction=1.5", "train.decay_fraction"),
    ("train.decay_shape=cosine", "train.decay_shape"),
    (["train.lr_schedule=wsd", "train.decay_fraction=0.95"], "train.decay_fraction"),  # overlaps the warmup
    ("train.schedule_override=yes please", "train.schedule_override"),
    # parallel
    ("parallel.tp=0", "parallel.tp"),
    ("parallel.sequence_parallel=true", "parallel.sequence_parallel"),   # tp=1: no tp ranks to split over
    ("parallel.tp=3", "parallel.tp"),                         # 2 GDN heads are not divisible by 3
    ("parallel.pp=0", "parallel.pp"),
    (["parallel.pp=4", "train.microbatch_size=2"], "train.microbatch_size"),  # 2 micro-batches, 4 stages
    (["parallel.pp=8", "train.microbatch_size=1", "train.batch_size=8"], "parallel.pp"),  # 4 layers
    ("parallel.cp=0", "parallel.cp"),
    ("parallel.cp=3", "parallel.cp"),                         # 1024 tokens do not split in 3
    ("parallel.dp=0", "parallel.dp"),
    ("parallel.sequence_parallel=2", "parallel.sequence_parallel"),
    ("parallel.pp_schedule=gpipe", "parallel.pp_schedule"),
    ("parallel.microbatches=2", "parallel.microbatches is gone"),  # replaced by train.microbatch_size
    ("train.eval_batches=2", "train.eval_batches is gone: set train.eval_rows"),
    ("parallel.virtual_stages=0", "parallel.virtual_stages"),
    ("parallel.virtual_stages=2", "parallel.virtual_stages"),  # 1f1b has one stage per rank
    ("parallel.data_parallel=zero", "parallel.data_parallel"),
    # DDP keeps whole parameters: nothing to gather once
    (["parallel.data_parallel=ddp", "parallel.fsdp_reshard_after_forward=false"],
     "parallel.fsdp_reshard_after_forward"),
    ("parallel.cp_algorithm=ring", "parallel.cp_algorithm"),
    ("parallel.cp_attention_split=ring", "parallel.cp_attention_split"),
    # shards of 129 tokens do not halve into zigzag's query blocks
    (["parallel.cp=8", "train.seq_len=258", "parallel.cp_attention_split=zigzag"],
     "parallel.cp_attention_split"),
    ("train.max_skipped_steps=0", "train.max_skipped_steps"),
    ("train.profile_steps=10-12", "train.profile_steps"),
    ("train.profile_steps=5,2", "train.profile_steps"),
    ("train.profile_steps=100000", "train.profile_steps"),  # past train.steps
    ("train.collective_timeout_s=0", "train.collective_timeout_s"),
    ("train.collective_timeout_s=0.5", "train.collective_timeout_s"),   # under a second: no step fits
    ("train.collective_timeout_s=-600", "train.collective_timeout_s"),
    ("train.collective_timeout_s=.inf", "train.collective_timeout_s"),  # a hang again
    ("train.collective_timeout_s=.nan", "train.collective_timeout_s"),
    ("train.collective_timeout_s=1e9", "train.collective_timeout_s"),   # beyond a day
    ("train.collective_timeout_s=soon", "train.collective_timeout_s"),
    ("data.text_suffixes=txt", "data.text_suffixes"),
    ("data.text_suffixes='*.txt'", "data.text_suffixes"),
    ("data.packing=rows", "data.packing"),
    ("data.source=''", "data.source"),                          # names no data without data.blend
    ("data.blend=[[1, stdlib]]", "data.source"),                # both name the data
    (["data.source=''", "data.blend=[[0, stdlib]]"], "data.blend[0]"),
    (["data.source=''", "data.blend={stdlib: 1}"], "data.blend"),
    # checkpoint
    ("checkpoint.interval=-1", "checkpoint.interval"),
    ("checkpoint.interval=5", "checkpoint.interval"),          # no train.out_dir to write under
    ("checkpoint.keep=-2", "checkpoint.keep"),
    ("checkpoint.async_save=2", "checkpoint.async_save"),
    ("checkpoint.enabled=maybe", "checkpoint.enabled"),
    ("checkpoint.verify=sometimes", "checkpoint.verify"),
    ("checkpoint.allow_other_run=perhaps", "checkpoint.allow_other_run"),
    # log
    ("log.tensorboard=maybe", "log.tensorboard"),
    ("log.wandb_project=[1]", "log.wandb_project"),
    ("log.wandb_mode=cloud", "log.wandb_mode"),
    ("log.progress_bar=sometimes", "log.progress_bar"),
]


@pytest.mark.parametrize("overrides,field", BAD_INPUTS, ids=[str(o) for o, _ in BAD_INPUTS])
def test_bad_input_fails_at_load_naming_the_field(overrides, field):
    """At load, or where the config first meets the model (the layer pattern's rules are the model's)."""
    with pytest.raises(ConfigError) as info:
        config = Config.from_yaml(TINY, [overrides] if isinstance(overrides, str) else overrides)
        check_layers(config.model, config.parallel.tp)
    assert field in str(info.value)


def test_zigzag_needs_a_row_of_two_blocks_a_rank():
    """The row must divide by 2 x cp under zigzag (and only under zigzag); the error names the field,
    the length and the fix."""
    odd_shards = ["parallel.cp=8", "train.seq_len=258"]             # 1032 tokens, 129 a rank
    assert Config.from_yaml(TINY, odd_shards).parallel.cp_attention_split == "contiguous"
    with pytest.raises(ConfigError, match=r"parallel.cp_attention_split=zigzag .* 1032 tokens does not "
                                          r"divide by 16: change train.seq_len"):
        Config.from_yaml(TINY, [*odd_shards, "parallel.cp_attention_split=zigzag"])
    assert Config.from_yaml(TINY, ["parallel.cp=4", "parallel.cp_attention_split=zigzag"]).parallel.cp == 4


def loaded_for_the_model(overrides) -> Config:
    """A config as the trainer takes it: validated on load, then checked against the model's layers."""
    config = Config.from_yaml(TINY, overrides)
    check_layers(config.model, config.parallel.tp)
    return config


def test_tp_splits_only_the_heads_of_layers_the_model_has():
    """A pure GDN model has no attention heads to split, a pure attention model no GDN heads."""
    pure_gdn = ["model.layer_pattern=G", "model.gdn_num_heads=8", "model.gdn_head_dim=16", "parallel.tp=8"]
    loaded_for_the_model(pure_gdn)
    with pytest.raises(ConfigError, match="model.attn_num_heads=4 is not divisible by parallel.tp=8"):
        loaded_for_the_model(pure_gdn[1:])  # the same with the G/S hybrid: 4 attention heads
    pure_attention = ["model.layer_pattern=A", "model.attn_num_heads=8", "parallel.tp=8"]
    loaded_for_the_model(pure_attention)  # 2 GDN heads, but no GDN layer
    with pytest.raises(ConfigError, match="model.gdn_num_heads=2 is not divisible by parallel.tp=8"):
        loaded_for_the_model(pure_attention[1:])


def test_bad_inputs_cover_every_field():
    named = {field for _, field in BAD_INPUTS}
    every = {f"{section}.{name}" for section, values in Config().to_dict().items() for name in values}
    assert every - named == set()


def test_vocabulary_smaller_than_the_data_fails_at_start_up():
    """Checked against the data's largest token id (its metadata), before the model is built."""
    from gdn_parallel.config import DataConfig
    from gdn_parallel.data import check_vocabulary
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        check_vocabulary(DataConfig(), 100)
    check_vocabulary(DataConfig(), 256)


def test_an_empty_config_file_is_refused_not_trained_as_the_defaults(tmp_path):
    for text in ("", "# only a comment\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml' is empty \(or only comments\)"):
            Config.from_yaml(path)


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  hidden_size: 64\n  n_layers: [1\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml.* line 4"):
        Config.from_yaml(path)
    with pytest.raises(ConfigError, match="train.lr"):
        Config.from_yaml(TINY, ["train.lr=[1"])


def test_a_key_given_twice_names_both_lines(tmp_path):
    """YAML itself keeps the last of two equal keys; a config doing that is refused."""
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 3\n  lr: 1.0e-3\n  steps: 5\nmodel:\n  n_layers: 2\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml', line 4: the key 'steps' appears twice in one "
                                          r"section \(first on line 2\); keep one"):
        Config.from_yaml(path)
    path.write_text("train:\n  steps: 3\nmodel:\n  steps: 3\n")   # the same name in two sections is fine
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['model.steps'\]"):
        Config.from_yaml(path)


@pytest.mark.parametrize("word, value", [("off", "off"), ("on", "on"), ("no", "off"), ("true", "on"),
                                         ("auto", "auto")])
def test_on_off_fields_take_yaml_booleans(tmp_path, word, value):
    """YAML 1.1 reads a bare off/on/no/true as a boolean; a field whose choices are on/off takes them."""
    assert Config.from_yaml(TINY, [f"log.progress_bar={word}"]).log.progress_bar == value
    path = tmp_path / "bar.yaml"
    path.write_text(f"log:\n  progress_bar: {word}\n")
    assert Config.from_yaml(path).log.progress_bar == value
    with pytest.raises(ConfigError, match="train.out_dir=False must be a string"):  # other text fields do not
        Config.from_yaml(TINY, ["train.out_dir=off"])


def test_a_text_field_takes_a_bare_integer_as_the_text_written(tmp_path):
    """YAML reads `profile_steps: 3` (one step) as the integer 3; the field keeps "3" (torchrun on 2 H200s,
    2026-11-28: `--set train.profile_steps=7` stopped with "must be a string")."""
    settings = ["train.steps=5", "train.warmup_steps=1"]
    assert Config.from_yaml(TINY, [*settings, "train.profile_steps=3"]).train.profile_window == (3, 3)
    path = tmp_path / "profile.yaml"
    path.write_text("train:\n  steps: 5\n  warmup_steps: 1\n  profile_steps: 3\n")
    assert Config.from_yaml(path).train.profile_steps == "3"


def test_out_dir_must_be_a_directory_that_can_be_written(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for bad in (afile, afile / "run"):
        with pytest.raises(ConfigError, match="train.out_dir"):
            TrainConfig(out_dir=str(bad)).validate()
    TrainConfig(out_dir=str(tmp_path / "new" / "run")).validate()
    assert not (tmp_path / "new").exists()  # validation creates nothing
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="train.out_dir"):
            TrainConfig(out_dir=str(locked / "run")).validate()


def test_configs_built_in_code_are_held_to_the_same_rules():
    with pytest.raises(ConfigError, match="model.gdn_use_gate"):
        ModelConfig(gdn_use_gate="yes").validate()
    with pytest.raises(ConfigError, match="model.norm_eps"):
        ModelConfig(norm_eps=-1).validate()


# What a config asks of the Triton kernels is checked at start-up (check_kernels, called by both
# trainers before the model is built): the config module sits below the ops and knows no kernels.
def test_triton_gdn_on_cpu_fails_at_start_up(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run it on CPU
    config = Config.from_yaml(TINY, ["model.gdn_impl=triton", "train.device=cpu"])
    with pytest.raises(ConfigError, match="model.gdn_impl"):
        check_kernels(config.model, on_cuda=False)


@pytest.mark.skipif(kernel_module("gated_delta_rule") is None, reason="needs triton")
def test_triton_chunk_size_is_the_kernels():
    with pytest.raises(ConfigError, match="model.gdn_chunk_size=32"):
        check_kernels(ModelConfig(gdn_impl="triton", gdn_chunk_size=32), on_cuda=True)
    # auto: PyTorch chunks
    check_kernels(ModelConfig(gdn_chunk_size=32), on_cuda=False)
    with pytest.raises(ConfigError, match="model.gdn_chunk_size=32"):  # auto on CUDA runs the kernels
        check_kernels(ModelConfig(gdn_chunk_size=32), on_cuda=True)


def test_triton_kda_is_checked_at_start_up_when_the_model_has_kda_layers(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kda = ModelConfig(layer_pattern="KA", kda_impl="triton")
    with pytest.raises(ConfigError, match="model.kda_impl='triton' cannot run on the CPU"):
        check_kernels(kda, on_cuda=False)
    # the same field in a model without KDA layers asks nothing of the KDA kernels
    check_kernels(ModelConfig(layer_pattern="GA", kda_impl="triton"), on_cuda=False)
    if kernel_module("kda") is not None:     # auto on CUDA runs the KDA kernels: their chunk length
        with pytest.raises(ConfigError, match="model.kda_chunk_size=32"):
            check_kernels(ModelConfig(layer_pattern="KA", kda_chunk_size=32), on_cuda=True)


def test_every_mixer_declares_its_kernel_check():
    """A kind without one cannot be made (the field is required), and each runs only for its layers."""
    assert all(callable(kind.kernel_check) for kind in MIXERS.values())
    check_kernels(ModelConfig(layer_pattern="G", attn_impl="flex"), on_cuda=False)   # no attention layers
    with pytest.raises(ConfigError, match="model.attn_impl='flex'"):
        check_kernels(ModelConfig(layer_pattern="GA", attn_impl="flex"), on_cuda=False)


def test_wide_gdn_heads_are_accepted_on_cuda():
    # fp32 at K = 256 was refused on CUDA until its GPU tests passed (docs/kernels.md)
    check_kernels(ModelConfig(gdn_head_dim=256, gdn_expand_v=1.0, hidden_size=256), on_cuda=True)


def test_collective_timeout_names_its_range_and_the_first_steps_it_must_outlast():
    with pytest.raises(ConfigError, match=r"train.collective_timeout_s=0.0 must be a number of seconds in "
                                          r"\[1, 86400\].*Triton compilation.*e.g. 600"):
        TrainConfig(collective_timeout_s=0).validate()
    # > the ~3 min of Triton compilation in the first steps
    assert TrainConfig().collective_timeout_s == 600.0
    assert Config.from_yaml(TINY, ["train.collective_timeout_s=30"]).train.collective_timeout_s == 30.0
