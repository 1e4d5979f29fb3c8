"""The mixer registry (gdn_parallel/model/mixers.py) drives every place a layer type matters: a toy mixer
registered here builds, trains, counts its FLOPs, splits over tensor parallelism and has an
architecture, with no other change to the package; its context-parallel form decides whether a config
with parallel.cp or train.recompute_chunks is taken, and the built-in mixers' forms are what their ops do."""
import ast
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gdn_parallel.checkpoint.loading import check_compatible
from gdn_parallel.comm import CPContext
from gdn_parallel.config import Config, ConfigError, ModelConfig
from gdn_parallel.convert.hf_format import format_refusals
from gdn_parallel.model import (
    MIXERS,
    HybridLM,
    MixerKind,
    SequenceInfo,
    TensorParallelLayout,
    architecture,
    architecture_differences,
    check_layers,
)
from gdn_parallel.model.mixers import (
    HALO_EXCHANGE,
    KV_ALL_GATHER,
    NOT_SPLIT,
    STATE_RELAY,
    ContextParallelForm,
)
from gdn_parallel.ops.rope import positions_from_cu_seqlens
from gdn_parallel.parallel.checkpointing import _chunk_sequences, apply_activation_checkpointing
from gdn_parallel.train.memory_model import activation_bytes_per_token, predict_peak, settings_that_fit
from tests.compare import assert_close_set
from tests.parallel.launcher import run_workers
from tests.parallel.test_tensor_parallel import model_config, train_equal

PACKAGE = Path(__file__).resolve().parents[2] / "gdn_parallel"
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"
TOY_FLOPS_PER_HEAD = 1000.0


class RunningMean(nn.Module):
    """A toy mixer: per head, the running mean over the row of silu(in_proj(x)), scaled per channel
    (`decay`, split over tp) and per head channel (`head_scale`, shared by the heads: a partial
    gradient under tp)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.attn_num_heads, config.attn_dim
        width = self.num_heads * self.head_dim
        self.in_proj = nn.Linear(config.hidden_size, width, bias=True)
        self.decay = nn.Parameter(torch.rand(width) + 0.5)
        self.head_scale = nn.Parameter(torch.rand(self.head_dim) + 0.5)
        self.out = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x, seq):
        B, T, _ = x.shape
        h = (F.silu(self.in_proj(x)) * self.decay).view(B, T, self.num_heads, self.head_dim) * self.head_scale
        h = h.cumsum(1) / torch.arange(1, T + 1, dtype=h.dtype, device=h.device).view(1, T, 1, 1)
        return self.out(h.reshape(B, T, -1))


def _check_two_heads(config: ModelConfig, tp: int) -> None:
    if config.attn_num_heads < 2:
        raise ConfigError(f"model.attn_num_heads={config.attn_num_heads}: the toy mixer needs two heads")


TOY = MixerKind(
    symbol="T", description="toy running mean", module=RunningMean, build=RunningMean,
    fields=("attn_num_heads", "attn_head_dim"),
    flops_per_token=lambda config, seq_len: TOY_FLOPS_PER_HEAD * config.attn_num_heads,
    architecture=lambda config: {"toy heads (model.attn_num_heads)": config.attn_num_heads,
                                 "toy head (model.attn_head_dim)": config.attn_dim},
    tp_split=lambda config: [("model.attn_num_heads", config.attn_num_heads)],
    tensor_parallel=TensorParallelLayout(column=("in_proj",), row=("out",), split=(("decay", 0),),
                                         partial_grad=("head_scale",), heads=("num_heads",)),
    # its running mean spans the whole row it is given: it has no form for a piece of one
    context_parallel=NOT_SPLIT,
    # kept: in_proj's output and the scaled mean (bf16); in the backward: their gradients
    activation_bytes_per_token=lambda config: (2 * 2 * config.attn_num_heads * config.attn_dim,
                                               2 * 2 * config.attn_num_heads * config.attn_dim),
    kernel_check=lambda config, on_cuda: None,     # plain PyTorch: runs anywhere
    output_projection="out", check=_check_two_heads)


@contextlib.contextmanager
def registered(kind: MixerKind):
    assert kind.symbol not in MIXERS
    MIXERS[kind.symbol] = kind
    try:
        yield kind
    finally:
        del MIXERS[kind.symbol]


@pytest.fixture
def toy():
    with registered(TOY) as kind:
        yield kind


def toy_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, n_layers=2, layer_pattern="GT", gdn_num_heads=2,
                gdn_head_dim=8, attn_num_heads=4, gdn_chunk_size=16, intermediate_size=48)
    return ModelConfig(**{**base, **overrides})


def test_a_registered_mixer_builds_trains_and_is_scaled_at_init(toy):
    torch.manual_seed(0)
    config = toy_config()
    model = HybridLM(config)
    assert isinstance(model.layers[1].attn, RunningMean)
    # its output projection is the residual output scaled by 1/sqrt(2 * n_layers) = 1/2
    ratio = model.layers[1].attn.out.weight.std() / model.layers[1].attn.in_proj.weight.std()
    assert 0.4 < ratio < 0.6, ratio
    ids = torch.randint(0, 64, (2, 12))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model(ids, labels=ids).loss
    first.backward()
    toy_grads = {name: p.grad for name, p in model.layers[1].attn.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in toy_grads.values()), toy_grads.keys()
    optimizer.step()
    assert model(ids, labels=ids).loss < first


def test_a_registered_mixer_counts_its_flops_and_architecture(toy):
    config, seq_len = toy_config(), 128
    model = HybridLM(config)
    matmul = model.num_parameters(exclude_embeddings=True)
    mixers = MIXERS["G"].flops_per_token(config, seq_len) + TOY_FLOPS_PER_HEAD * config.attn_num_heads
    assert model.flops_per_token(seq_len) == 6.0 * matmul + 3.0 * mixers
    arch = architecture(config)
    assert arch["toy heads (model.attn_num_heads)"] == 4 and "model.window_size" not in arch
    assert "model.gdn_head_dim" in arch
    differing = architecture_differences(config, toy_config(attn_num_heads=2))
    assert set(differing) == {"toy heads (model.attn_num_heads)", "toy head (model.attn_head_dim)"}


def test_an_export_format_refuses_a_mixer_it_cannot_express(toy):
    assert format_refusals(toy_config(layer_pattern="GS")) == []
    refused = format_refusals(toy_config())
    assert len(refused) == 1 and "toy running mean layers (T in model.layer_pattern)" in refused[0]


def test_a_registered_mixer_runs_its_check_and_head_split(toy):
    with pytest.raises(ConfigError, match="the toy mixer needs two heads"):
        HybridLM(toy_config(attn_num_heads=1))
    check_layers(toy_config(layer_pattern="G", attn_num_heads=1))   # no toy layer: its check does not run
    with pytest.raises(ConfigError, match="model.attn_num_heads=4 is not divisible by parallel.tp=8"):
        check_layers(toy_config(gdn_num_heads=8), tp=8)


def toy_tp_cases(rank, world):
    with registered(TOY):
        for sp in (False, True):
            train_equal(dist.group.WORLD, sp, model_config(layer_pattern="GT", n_layers=2), tag="toy")
    return True


def test_a_registered_mixer_splits_over_tp_as_its_layout_says():
    """tp=2 (gloo) equals one process: loss, gradients (the partial head_scale reduced), parameters."""
    assert all(run_workers(toy_tp_cases, 2))


def test_an_unknown_symbol_names_the_field_and_the_registered_mixers():
    config = ModelConfig(layer_pattern="GX", n_layers=2)
    for attempt in (lambda: check_layers(config), lambda: HybridLM(config)):
        with pytest.raises(ConfigError) as info:
            attempt()
        message = str(info.value)
        assert "model.layer_pattern='GX'" in message and "['X']" in message
        assert all(f"{kind.symbol} ({kind.description})" in message for kind in MIXERS.values())


def saved_state(model: ModelConfig) -> dict:
    return {"config": {"model": dataclasses.asdict(model)}}


def test_resume_compares_the_resolved_architecture():
    pure_gdn = ModelConfig(layer_pattern="G", n_layers=2)
    saved = saved_state(pure_gdn)
    # what does not decide a pure GDN model's weights may change: the chunk size, attention fields
    for free in (dict(gdn_chunk_size=32), dict(attn_num_heads=8, window_size=7, rope_theta=5e5),
                 dict(gdn_impl="chunk", initializer_range=0.01)):
        check_compatible(saved, Config(model=dataclasses.replace(pure_gdn, **free)))
    check_compatible({"config": {"model": {**saved["config"]["model"], "retired_field": 1}}},
                     Config(model=pure_gdn))
    with pytest.raises(ConfigError) as info:
        check_compatible(saved, Config(model=dataclasses.replace(pure_gdn, gdn_head_dim=16)))
    message = str(info.value)
    assert "model.gdn_head_dim: checkpoint 32, config 16" in message and "config.yaml" in message
    hybrid = ModelConfig(layer_pattern="GS", n_layers=2)
    with pytest.raises(ConfigError, match="model.window_size: checkpoint 64, config 32"):
        check_compatible(saved_state(hybrid), Config(model=dataclasses.replace(hybrid, window_size=32)))


def test_every_model_field_belongs_to_a_mixer_or_to_the_whole_model():
    """A new field is claimed by the mixer that reads it (MixerKind.fields) or is model-wide."""
    model_wide = {"vocab_size", "hidden_size", "n_layers", "layer_pattern", "hidden_ratio",
                  "intermediate_size", "norm_eps", "tie_word_embeddings", "initializer_range",
                  "fused_linear_cross_entropy", "residual_in_fp32"}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    claimed = {name for kind in MIXERS.values() for name in kind.fields}
    assert claimed <= fields, claimed - fields
    assert fields - claimed - model_wide == set()


def _resolves(module: nn.Module, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(module, name):
            return False
        module = getattr(module, name)
        if module is None:   # an optional part the layout skips
            return True
    return True


@pytest.mark.parametrize("symbol", sorted(MIXERS))
def test_every_tensor_parallel_path_names_a_part_of_the_module(symbol):
    kind = MIXERS[symbol]
    config = ModelConfig(conv_bias=True, attn_qkv_bias=True, attn_output_gate=True)
    module = kind.build(config)
    assert isinstance(module, kind.module) and _resolves(module, kind.output_projection)
    layout = kind.tensor_parallel
    paths = [*layout.column, *layout.row, *(path for path, _ in layout.split), *layout.partial_grad]
    if layout.grouped_kv is not None:
        paths += [*layout.grouped_kv.projections, layout.grouped_kv.count, layout.grouped_kv.head_dim]
    missing = [path for path in [*paths, *layout.heads] if not _resolves(module, path)]
    assert not missing, f"{symbol}: {missing}"


def test_layer_symbols_are_spelled_only_in_the_registry():
    """Code elsewhere asks MIXERS (or a MixerKind's facts), never compares with a symbol's letter."""
    symbols = set(MIXERS)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "model" / "mixers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            single = isinstance(node, ast.Constant) and node.value in symbols
            membership = (isinstance(node, ast.Compare)
                          and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                          and any(isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value
                                  and set(c.value) <= symbols for c in node.comparators))
            if single or membership:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"layer symbols spelled outside model/mixers.py: {found}"


# ---------------------------------------------------------------- context parallelism and recompute chunks
CHUNKED = ["train.activation_checkpointing=full"]
# (overrides on configs/tiny-cpu.yaml that split the row, the setting a refusal names first)
SPLITS = [(["parallel.cp=2"], "parallel.cp=2"), (["parallel.cp=4"], "parallel.cp=4"),
          ([*CHUNKED, "train.recompute_chunks=2"], "train.recompute_chunks=2"),
          ([*CHUNKED, "train.recompute_chunks=4"], "train.recompute_chunks=4"),
          (["parallel.cp=2", *CHUNKED, "train.recompute_chunks=2"], "parallel.cp=2")]
SPLIT_IDS = [" ".join(overrides) for overrides, _ in SPLITS]


def validated(overrides) -> Config:
    """A config as the trainer takes it: validated on load, then checked against the model's layers
    with the parallel degrees and recompute chunks that split its rows."""
    config = Config.from_yaml(TINY, overrides)
    check_layers(config.model, config.parallel.tp, config.parallel.cp, config.train.recompute_chunks)
    return config


@pytest.mark.parametrize("pattern", ["T", "GT", "TS", "SGTG"])
@pytest.mark.parametrize("split,field", SPLITS, ids=SPLIT_IDS)
def test_a_mixer_without_a_context_parallel_form_is_refused_under_every_split(toy, pattern, split, field):
    validated([f"model.layer_pattern={pattern}"])   # whole rows: taken
    with pytest.raises(ConfigError) as info:
        validated([f"model.layer_pattern={pattern}", *split])
    message = str(info.value)
    setting = field.split("=")[0]
    assert message.startswith(f"{field}: toy running mean layers (T in model.layer_pattern)"), message
    assert NOT_SPLIT.limit in message and f"use {setting}=1, or a model.layer_pattern without T" in message


def test_a_split_is_refused_only_where_the_refusing_mixer_has_layers(toy):
    for split, _ in SPLITS:
        validated(["model.layer_pattern=GS", *split])


def test_recompute_chunks_over_a_refusing_mixer_are_refused_where_blocks_are_wrapped(toy):
    """parallel/checkpointing.py reads the same declaration for the blocks a process holds."""
    with pytest.raises(ConfigError, match=r"train.recompute_chunks=2: toy running mean layers \(T in"):
        apply_activation_checkpointing(HybridLM(toy_config()), "full", chunks=2)
    apply_activation_checkpointing(HybridLM(toy_config()), "full")   # whole blocks: taken


def test_a_mixer_declaring_a_form_is_taken_where_its_form_runs():
    both = dataclasses.replace(TOY, context_parallel=ContextParallelForm(
        "a toy hand-over", across_ranks=True, across_chunks=True))
    with registered(both):
        for split, _ in SPLITS:
            validated(["model.layer_pattern=GT", *split])
        apply_activation_checkpointing(HybridLM(toy_config()), "full", chunks=2)
    ranks_only = dataclasses.replace(TOY, context_parallel=ContextParallelForm(
        "a toy gather", across_ranks=True, across_chunks=False, limit="the toy gathers the whole row"))
    with registered(ranks_only):
        validated(["model.layer_pattern=GT", "parallel.cp=4"])
        with pytest.raises(ConfigError, match=r"train.recompute_chunks=2: toy running mean layers \(T in "
                                              r"model.layer_pattern\) .*: the toy gathers the whole row"):
            validated(["model.layer_pattern=GT", *CHUNKED, "train.recompute_chunks=2"])


def test_the_memory_model_suggests_no_split_a_mixer_refuses():
    """settings_that_fit offers recompute chunks or more CP ranks only where every layer takes them."""
    config = Config.from_yaml(TINY, ["model.layer_pattern=GT", *CHUNKED, "train.activation_offload=cpu",
                                     "train.batch_size=1"])
    splitting = dataclasses.replace(TOY, context_parallel=ContextParallelForm("a toy hand-over", True, True))
    with registered(splitting):
        whole = predict_peak(config).peak_gib
        split = predict_peak(config.with_overrides(["parallel.cp=64"])).peak_gib
        assert split < whole
        capacity = (whole + split) / 2
        suggested = settings_that_fit(config, capacity)
        assert suggested and suggested[-1].startswith(("train.recompute_chunks=", "parallel.cp=")), suggested
    with registered(TOY):
        assert settings_that_fit(config, capacity) == []


def test_a_mixer_must_declare_its_context_parallel_form_memory_and_kernel_check():
    """Required fields: a new mixer cannot leave any out (the memory model would count 0 bytes, a kernel
    that cannot run here would fail at its first call)."""
    declared = {f.name: getattr(TOY, f.name) for f in dataclasses.fields(MixerKind)}
    MixerKind(**declared)
    for required in ("context_parallel", "activation_bytes_per_token", "kernel_check"):
        with pytest.raises(TypeError, match=required):
            MixerKind(**{name: value for name, value in declared.items() if name != required})
    # the memory model counts the mixer's share on top of the block's own
    config, blocks = toy_config(), []
    for kind in (TOY, dataclasses.replace(TOY, activation_bytes_per_token=lambda config: (0.0, 0.0))):
        with registered(kind):
            blocks.append(activation_bytes_per_token("T", config))
    (kept, gradients), (block_kept, block_gradients) = blocks
    assert (kept - block_kept, gradients - block_gradients) == TOY.activation_bytes_per_token(config)


BUILT_IN_FORMS = {"G": STATE_RELAY, "K": STATE_RELAY, "S": HALO_EXCHANGE, "A": KV_ALL_GATHER}


def test_the_built_in_mixers_declare_what_their_ops_implement():
    """GDN and KDA: the state relay or the summary all-gather (and the conv halo); sliding window: the K/V
    halo; full attention: the K/V all-gather, across ranks only. The tests below run each form."""
    assert {symbol: kind.context_parallel for symbol, kind in MIXERS.items()} == BUILT_IN_FORMS
    assert [form for form in BUILT_IN_FORMS.values() if not form.across_chunks] == [KV_ALL_GATHER]
    assert all(form.across_ranks for form in BUILT_IN_FORMS.values())


# A row of documents crossing the boundaries of 3 chunks (or 2 ranks of 12 tokens), the window (6)
# reaching into the previous piece.
MIXER_CONFIG = ModelConfig(vocab_size=64, hidden_size=32, n_layers=1, gdn_num_heads=2, gdn_num_v_heads=4,
                           gdn_head_dim=8, gdn_chunk_size=8, gdn_impl="chunk", kda_num_heads=2,
                           kda_num_v_heads=4, kda_head_dim=8, kda_chunk_size=8, attn_num_heads=4,
                           attn_num_kv_heads=2, attn_impl="sdpa", window_size=6)
ROW, CU = 24, [0, 5, 17, 24]


def whole_row(symbol: str):
    """The mixer (float64, seeded), a row of inputs, the output gradient, and the whole row's output
    and input gradient on one process."""
    torch.manual_seed(0)
    module = MIXERS[symbol].build(MIXER_CONFIG).double()
    x = torch.randn(1, ROW, MIXER_CONFIG.hidden_size, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, ROW, MIXER_CONFIG.hidden_size, dtype=torch.float64)
    cu = torch.tensor(CU)
    positions = positions_from_cu_seqlens(cu, ROW).unsqueeze(0)
    y = module(x, SequenceInfo(cu_seqlens=cu, position_ids=positions))
    (dx,) = torch.autograd.grad((y * dy).sum(), x)
    return module, x.detach(), dy, positions, y.detach(), dx


@pytest.mark.parametrize("symbol", sorted(MIXERS))
def test_a_mixer_runs_in_recompute_chunks_as_its_form_declares(symbol):
    """The chunks are a CP plan one process runs in turn (parallel/checkpointing.py): a form that takes
    them gives the whole row's output and input gradient, one that does not fails in its ops."""
    module, x, dy, positions, y, dx = whole_row(symbol)
    chunks, x = 3, x.clone().requires_grad_()
    pieces = _chunk_sequences(SequenceInfo(cu_seqlens=torch.tensor(CU), position_ids=positions), x, chunks)
    length = ROW // chunks

    def chunked():
        return torch.cat([module(x[:, k * length:(k + 1) * length], piece) for k, piece in enumerate(pieces)],
                         dim=1)

    if MIXERS[symbol].context_parallel.across_chunks:
        y_chunked = chunked()
        (y_chunked * dy).sum().backward()
        assert_close_set({"y": y_chunked, "dx": x.grad}, {"y": y, "dx": dx}, 1e-10, symbol)
    else:
        with pytest.raises(ValueError, match="sequence chunks run in turn"):
            chunked()


def forms_across_ranks(rank, world):
    """Each built-in mixer that declares a form across ranks, on this rank's shard, under both CP
    algorithms: the whole row's output and input gradient."""
    for symbol, kind in MIXERS.items():
        if not kind.context_parallel.across_ranks:
            continue
        module, x, dy, positions, y, dx = whole_row(symbol)
        length = ROW // world
        s, e = rank * length, (rank + 1) * length
        for algorithm in ("relay", "allgather"):
            x_local = x[:, s:e].clone().requires_grad_()
            cp = CPContext.build(dist.group.WORLD, torch.tensor(CU), length, algorithm)
            y_local = module(x_local, SequenceInfo(position_ids=positions[:, s:e], cp=cp))
            (y_local * dy[:, s:e]).sum().backward()
            cp.finish()
            assert_close_set({"y": y_local, "dx": x_local.grad}, {"y": y[:, s:e], "dx": dx[:, s:e]}, 1e-10,
                             f"{symbol} {algorithm} rank {rank}")
    return True


def test_the_built_in_forms_across_ranks_equal_one_process():
    """cp = 2 (gloo): GDN's relay and summary all-gather, the sliding window's halo, full attention's
    K/V all-gather."""
    assert all(run_workers(forms_across_ranks, 2))
