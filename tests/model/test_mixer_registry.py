"""The mixer registry (gdn_parallel/model/mixers.py) drives every place a layer type matters: a toy mixer
registered here builds, trains, counts its FLOPs, splits over tensor parallelism and has an
architecture, with no other change to the package."""
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
from gdn_parallel.config import Config, ConfigError, ModelConfig
from gdn_parallel.convert.hf_format import format_refusals
from gdn_parallel.model import (
    MIXERS,
    HybridLM,
    MixerKind,
    TensorParallelLayout,
    architecture,
    architecture_differences,
    check_layers,
)
from tests.parallel.launcher import run_workers
from tests.parallel.test_tensor_parallel import model_config, train_equal

PACKAGE = Path(__file__).resolve().parents[2] / "gdn_parallel"
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
