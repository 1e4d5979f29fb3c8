"""The token mixers a layer pattern names: one `MixerKind` per symbol in `MIXERS`, the one place that
says what a layer type is (docs/design.md, "Adding a mixer").

Everything that differs between layer types reads its entry: building the module (model), its FLOPs,
the settings that decide its weights (model/architecture.py: conversions and resume), the head counts
tensor parallelism splits and the checks on them (`check_layers`), the residual output scaled at init,
how tensor parallelism slices it (`TensorParallelLayout`, data that parallel/tensor.py applies: the
model layer cannot import the parallel layer above it), how it runs on a row split over context-parallel
ranks or recompute chunks (`ContextParallelForm`, checked by `check_layers` and
parallel/checkpointing.py) and the activation memory it keeps (train/memory_model.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ..config import ConfigError, ModelConfig
from ..ops.triton_dispatch import check_attention_kernels, check_gdn_kernels, check_kda_kernels
from .attention import Attention
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention

# Which keys a softmax-attention query sees (MixerKind.attention): formats that describe attention
# layers by their window (fla's attn specs) map them to our symbols through it.
FULL_ATTENTION = "full causal"
SLIDING_WINDOW = "sliding window (model.window_size)"


@dataclass(frozen=True)
class GroupedKVHeads:
    """Grouped KV heads under tp: split when `count` divides by tp; otherwise (tp % count == 0, which
    the entry's check ensures) every rank keeps all of `projections` and computes the one head its
    query heads read, and `count` becomes 1."""
    projections: tuple[str, ...]
    count: str       # the module attribute holding the KV head count
    head_dim: str    # the module attribute holding the head size (rows per head of each projection)


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a mixer splits over tp ranks (Megatron's: column-parallel in, row-parallel out; docs/design.md
    §3). Names are attribute paths inside the mixer module ("q_conv1d.weight"); a path whose attribute
    is None (an optional projection or bias) is skipped."""
    column: tuple[str, ...] = ()                  # linears split by output rows (weight and bias, dim 0)
    row: tuple[str, ...] = ()                     # linears split by input columns (they may have no bias)
    split: tuple[tuple[str, int], ...] = ()       # other parameters: (path, dim) cut into tp equal slices
    partial_grad: tuple[str, ...] = ()            # replicated parameters each rank applies to its heads only
    heads: tuple[str, ...] = ()                   # head-count attributes divided by tp
    grouped_kv: GroupedKVHeads | None = None


@dataclass(frozen=True)
class ContextParallelForm:
    """How a mixer's ops run on one piece of a row cut contiguously (docs/design.md §2): over
    context-parallel ranks (parallel.cp > 1), or into sequence chunks that one process runs in turn
    (train.recompute_chunks > 1: a CP plan whose ranks are the chunks, comm.context.Loopback)."""
    name: str             # what crosses a boundary between pieces, in messages
    across_ranks: bool    # takes parallel.cp > 1
    across_chunks: bool   # takes train.recompute_chunks > 1
    limit: str = ""       # why it cannot take a split it refuses: its refusal says so


# The forms the ops implement. A piece crossed by a document receives what came before it.
STATE_RELAY = ContextParallelForm(
    "the state handed from piece to piece (parallel.cp_algorithm=relay; recompute chunks take only this) "
    "or the all-gathered segment summaries folded (allgather), with the short convolution's halo",
    across_ranks=True, across_chunks=True)
HALO_EXCHANGE = ContextParallelForm(
    "a halo of the previous window's keys and values", across_ranks=True, across_chunks=True)
KV_ALL_GATHER = ContextParallelForm(
    "an all-gather of the row's keys and values", across_ranks=True, across_chunks=False,
    limit="full-attention layers see every earlier key, and gathering them needs every piece of the row "
          "at once, where chunks run one after another")
NOT_SPLIT = ContextParallelForm(
    "none", across_ranks=False, across_chunks=False,
    limit="the mixer declares none (MixerKind.context_parallel), so its ops would see only their own "
          "piece of the row")


@dataclass(frozen=True)
class MixerKind:
    symbol: str                                   # its letter in model.layer_pattern
    description: str                              # names it in messages
    module: type[nn.Module]                       # the class `build` makes
    build: Callable[[ModelConfig], nn.Module]
    fields: tuple[str, ...]                       # its own ModelConfig fields (besides hidden_size, norm_eps)
    # Forward FLOPs per token beyond its matrix parameters (those count 6 per parameter in
    # HybridLM.flops_per_token), at a training row of seq_len tokens.
    flops_per_token: Callable[[ModelConfig, int], float]
    # The resolved settings that decide its weights and what it computes with them, keyed by readable
    # field names: two configs whose architectures agree hold the same weights (model/architecture.py).
    architecture: Callable[[ModelConfig], dict[str, object]]
    # (config field, head count) pairs that parallel.tp must divide.
    tp_split: Callable[[ModelConfig], list[tuple[str, int]]]
    tensor_parallel: TensorParallelLayout
    # How it runs on a row split over context-parallel ranks or recompute chunks: one of the forms
    # above (NOT_SPLIT refuses both), checked against parallel.cp and train.recompute_chunks.
    context_parallel: ContextParallelForm
    # Bytes per token the mixer keeps for its backward, and the gradients its backward holds beside
    # them (bf16 under autocast): train/memory_model.py adds the block's residual stream, norms and
    # MLP. Required: a mixer left out would predict a peak that does not fit as fitting.
    activation_bytes_per_token: Callable[[ModelConfig], tuple[float, float]]
    # What its config asks of the kernels on this machine (config, on_cuda), checked at start-up before a
    # model is built: ConfigError naming the field. Required: a mixer whose kernels cannot run here
    # would fail at its first call, after the data and the model were set up.
    kernel_check: Callable[[ModelConfig, bool], None]
    output_projection: str = "o_proj"             # the linear writing the residual: scaled at init
    check: Callable[[ModelConfig, int], None] | None = None   # (config, tp): rules beyond tp_split
    attention: str | None = None                  # softmax attention: FULL_ATTENTION or SLIDING_WINDOW


# ---------------------------------------------------------------- gated deltanet
def _gdn_flops(config: ModelConfig, seq_len: int) -> float:
    """The chunk algorithm's products per token (docs/design.md §1): the UT transform, the intra-chunk
    attention and the state read and write."""
    C, K, V = config.gdn_chunk_size, config.gdn_head_dim, config.head_v_dim
    return config.num_v_heads * (4 * C * K + 2 * C * V + C * (K + V) + 6 * K * V)


def _gdn_architecture(config: ModelConfig) -> dict[str, object]:
    return {"model.gdn_num_heads": config.gdn_num_heads, "model.gdn_num_v_heads": config.num_v_heads,
            "model.gdn_head_dim": config.gdn_head_dim,
            "GDN value head (gdn_head_dim * gdn_expand_v)": config.head_v_dim,
            "model.gdn_use_gate": config.gdn_use_gate,
            "model.gdn_allow_neg_eigval": config.gdn_allow_neg_eigval,
            "model.conv_size": config.conv_size, "model.conv_bias": config.conv_bias}


# q/k rows by q/k head, v/g/a/b rows by value head (a q/k head's value heads are contiguous, so
# splitting both counts evenly keeps each group on one rank); depthwise conv channels follow their
# projection; A_log and dt_bias by value head. o_norm's one weight is shared by all heads: each rank
# sees its heads only.
GDN_TENSOR_PARALLEL = TensorParallelLayout(
    column=("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"),
    row=("o_proj",),
    split=tuple((f"{conv}.{param}", 0) for conv in ("q_conv1d", "k_conv1d", "v_conv1d")
                for param in ("weight", "bias")) + (("A_log", 0), ("dt_bias", 0)),
    partial_grad=("o_norm.weight",),
    heads=("num_heads", "num_v_heads"))


# ---------------------------------------------------------------- kimi delta attention
def _kda_flops(config: ModelConfig, seq_len: int) -> float:
    """The chunk algorithm's products per token (ops/kda/chunk.py): the gated delta rule's, with the
    decayed key and query products spelt out per channel (P(K), P(Q): 2 x 3 C K where GDN's K K^T and
    Q K^T take 2 x 2 C K) and the state read and write."""
    C, K, V = config.kda_chunk_size, config.kda_head_dim, config.kda_head_v_dim
    return config.kda_v_heads * (6 * C * K + 2 * C * V + C * (K + V) + 6 * K * V)


def _kda_architecture(config: ModelConfig) -> dict[str, object]:
    return {"model.kda_num_heads": config.kda_num_heads, "model.kda_num_v_heads": config.kda_v_heads,
            "model.kda_head_dim": config.kda_head_dim,
            "KDA value head (kda_head_dim * kda_expand_v)": config.kda_head_v_dim,
            "model.kda_allow_neg_eigval": config.kda_allow_neg_eigval,
            "model.conv_size": config.conv_size, "model.conv_bias": config.conv_bias}


def _kda_activations(config: ModelConfig) -> tuple[float, float]:
    """Kept (bf16 under autocast but where said): the convolutions' inputs; the rule's q and k
    (normalised) and v; the decay logits and the low-rank inputs of f_proj and g_proj; the output gate,
    the rule's output and its normed product; and what the rule keeps, by the implementation that runs
    on a GPU (the memory check runs there): the Triton kernels' (model.kda_impl auto or triton), or the
    PyTorch chunk form's (chunk), whose autograd also keeps the per-channel terms of its decayed
    products. In the backward: dq, dk, dv, the decay's gradient and a value-sized one, and the kernels'
    own buffers. configs/kimi-1.3b.yaml on one H200 (tools/gpu_smoke.py): 69.9 GiB measured, 67 GiB
    predicted; with model.kda_impl=chunk 292 GiB predicted (it ran out of the H200's 140)."""
    HV, K, V = config.kda_v_heads, config.kda_head_dim, config.kda_head_v_dim
    key, value, decay = config.kda_num_heads * K, HV * V, HV * K
    layer = 2 * (2 * key + value) * 2 + 2 * (decay + 2 * config.kda_head_v_dim) + 2 * 3 * value
    gradients: float = 2 * (2 * key + value) + 4 * decay + 2 * value
    if config.kda_impl != "chunk":
        # the kernels' backward buffers beside them: fp32 partial dq, dk and dG [K each], dP(Q) and
        # dP(K) [64 each]; dDelta twice [V], dW [K] and the chunk states' gradients [K V / 64]
        gradients += HV * (3 * 4 * K + 2 * 4 * 64 + 2 * 2 * V + 2 * K + 2 * K * V / 64)
    return layer + _kda_rule_activations(config), gradients


def _kda_rule_activations(config: ModelConfig) -> float:
    """Bytes per token the rule itself keeps for its backward (see _kda_activations)."""
    HV, K, V, C = config.kda_v_heads, config.kda_head_dim, config.kda_head_v_dim, config.kda_chunk_size
    if config.kda_impl == "chunk":
        # fp32: decays, beta, W, U, the decayed keys and queries, two decayed products and the chunk
        # states; then each product's per-channel terms over its 16-token diagonal blocks (the masked
        # exponents, their exp and the products before the sum: three [C, 16, K] tensors a chunk).
        width = min(16, C)
        return 4 * HV * (K + 1 + 4 * K + V + 2 * C + K * V / C) + 2 * 3 * 4 * HV * width * K
    # gdn_kernels.kda (kernels/kda/__init__.py, _ChunkKDA's saved tensors): fp32 cumulative decays
    # [K] and P(K) [64], in the input dtype T and scale P(Q) [64 each], W, K to the chunk's end, the
    # decayed queries [K each], Delta [V] and the chunk-start states [K V / 64], fp32 beta.
    return HV * (4 * K + 4 * 64 + 2 * 2 * 64 + 2 * 3 * K + 2 * V + 2 * K * V / 64 + 4)


# As GDN's: q/k rows by q/k head, v/b rows, the decay's and the gate's second (head-sized) linears, conv
# channels, A_log and dt_bias by value head. The low-rank first linears of the decay and the gate read
# the whole input and feed every head: replicated, each rank's gradient from its own heads only; so is
# o_norm's one weight.
KDA_TENSOR_PARALLEL = TensorParallelLayout(
    column=("q_proj", "k_proj", "v_proj", "b_proj", "f_proj.1", "g_proj.1"),
    row=("o_proj",),
    split=tuple((f"{conv}.{param}", 0) for conv in ("q_conv1d", "k_conv1d", "v_conv1d")
                for param in ("weight", "bias")) + (("A_log", 0), ("dt_bias", 0)),
    partial_grad=("f_proj.0.weight", "g_proj.0.weight", "o_norm.weight"),
    heads=("num_heads", "num_v_heads"))


# ---------------------------------------------------------------- softmax attention
def _average_keys_seen(window: int | None, length: int) -> float:
    """Keys a query attends to, averaged over a causal sequence of `length` tokens, when each sees the
    `window` latest keys, itself included (None: every earlier key)."""
    seen = length if window is None else min(window, length)
    return (seen * (seen + 1) / 2 + (length - seen) * seen) / length


def _attention_flops(visible_keys: Callable[[ModelConfig, int], float]):
    def flops(config: ModelConfig, seq_len: int) -> float:
        # scores and the weighted sum of values: 2 x 2 FLOPs per visible key and channel
        return 4 * visible_keys(config, seq_len) * config.attn_num_heads * config.attn_dim
    return flops


def _attention_architecture(config: ModelConfig) -> dict[str, object]:
    return {"model.attn_num_heads": config.attn_num_heads, "model.attn_num_kv_heads": config.num_kv_heads,
            "attention head (model.attn_head_dim)": config.attn_dim, "model.rope_theta": config.rope_theta,
            "model.attn_qkv_bias": config.attn_qkv_bias, "model.attn_output_gate": config.attn_output_gate,
            "model.attn_qk_norm": config.attn_qk_norm,
            "RoPE channels of a head (model.attn_rotary_dim)": config.rotary_dim}


def _check_kv_heads(config: ModelConfig, tp: int) -> None:
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        raise ConfigError(f"model.attn_num_kv_heads={config.num_kv_heads} and parallel.tp={tp}: one must "
                          f"divide the other (KV heads are split, or replicated when fewer than tp)")


ATTENTION_FIELDS = ("attn_num_heads", "attn_num_kv_heads", "attn_head_dim", "rope_theta", "attn_output_gate",
                    "attn_qkv_bias", "attn_qk_norm", "attn_rotary_dim", "attn_impl")
# q and output-gate rows by query head; KV heads split or replicated (GroupedKVHeads). The query and key
# norms' one weight each is shared by all heads: each rank sees its heads only.
ATTENTION_TENSOR_PARALLEL = TensorParallelLayout(
    column=("q_proj", "g_proj"), row=("o_proj",), heads=("num_heads",),
    partial_grad=("q_norm.weight", "k_norm.weight"),
    grouped_kv=GroupedKVHeads(projections=("k_proj", "v_proj"), count="num_kv_heads", head_dim="head_dim"))


def _gdn_activations(config: ModelConfig) -> tuple[float, float]:
    """Kept (bf16 under autocast but where said): the convolutions' inputs; the rule's q and k
    (normalised) and v, its UT-inverse rows, fp32 beta and decay, and the chunk states, W and Delta
    its forward keeps for the backward (gdn_kernels' default, TUNING["save_chunk_states"]); the
    output gate, the rule's output and its normed product. In the backward: dq, dk, dv and a
    value-sized gradient. (A block measured 111.6 KiB a token at hidden 2048 against 110.6 counted
    with its MLP and residual, docs/benchmarks.md.)"""
    HV, K, V, C = config.num_v_heads, config.gdn_head_dim, config.head_v_dim, config.gdn_chunk_size
    key, value = config.gdn_num_heads * K, HV * V
    kept = (2 * (2 * key + value) * 2 + 2 * HV * C + 4 * 2 * HV
            + 2 * (HV * K + HV * K * V / C + value) + 2 * 3 * value)
    return kept, 2 * (2 * key + value) + 2 * value


def _attention_activations(config: ModelConfig) -> tuple[float, float]:
    """Kept: q, k, v after rotary, the attention's output (bf16) and its log-sum-exp (fp32), with
    query/key norms also their inputs; the output gate's input. In the backward: dq, dk, dv."""
    q, kv = config.attn_num_heads * config.attn_dim, config.num_kv_heads * config.attn_dim
    normed = 2 * (q + kv) if config.attn_qk_norm else 0
    gate = 2 * q if config.attn_output_gate else 0
    return 2 * (q + 2 * kv) + 2 * q + 4 * config.attn_num_heads + normed + gate, 2 * (q + 2 * kv)


def _attention_heads(config: ModelConfig) -> list[tuple[str, int]]:
    return [("model.attn_num_heads", config.attn_num_heads)]


MIXERS: dict[str, MixerKind] = {kind.symbol: kind for kind in (
    MixerKind(
        symbol="G", description="gated deltanet", module=GatedDeltaNet, build=GatedDeltaNet,
        fields=("gdn_num_heads", "gdn_num_v_heads", "gdn_head_dim", "gdn_expand_v", "gdn_use_gate",
                "gdn_allow_neg_eigval", "gdn_chunk_size", "gdn_impl", "conv_size", "conv_bias"),
        flops_per_token=_gdn_flops, architecture=_gdn_architecture,
        tp_split=lambda config: [("model.gdn_num_heads", config.gdn_num_heads),
                                 ("model.gdn_num_v_heads", config.num_v_heads)],
        tensor_parallel=GDN_TENSOR_PARALLEL, context_parallel=STATE_RELAY,
        activation_bytes_per_token=_gdn_activations, kernel_check=check_gdn_kernels),
    MixerKind(
        symbol="K", description="kimi delta attention", module=KimiDeltaAttention, build=KimiDeltaAttention,
        fields=("kda_num_heads", "kda_num_v_heads", "kda_head_dim", "kda_expand_v", "kda_allow_neg_eigval",
                "kda_chunk_size", "kda_impl", "conv_size", "conv_bias"),
        flops_per_token=_kda_flops, architecture=_kda_architecture,
        tp_split=lambda config: [("model.kda_num_heads", config.kda_num_heads),
                                 ("model.kda_num_v_heads", config.kda_v_heads)],
        tensor_parallel=KDA_TENSOR_PARALLEL, context_parallel=STATE_RELAY,
        activation_bytes_per_token=_kda_activations, kernel_check=check_kda_kernels),
    MixerKind(
        symbol="S", description="sliding-window attention", module=Attention,
        build=lambda config: Attention(config, window=config.window_size),
        fields=(*ATTENTION_FIELDS, "window_size"),
        flops_per_token=_attention_flops(lambda config, n: _average_keys_seen(config.window_size, n)),
        architecture=lambda config: {**_attention_architecture(config),
                                     "model.window_size": config.window_size},
        tp_split=_attention_heads, tensor_parallel=ATTENTION_TENSOR_PARALLEL, check=_check_kv_heads,
        attention=SLIDING_WINDOW, context_parallel=HALO_EXCHANGE,
        activation_bytes_per_token=_attention_activations, kernel_check=check_attention_kernels),
    MixerKind(
        symbol="A", description="full causal attention", module=Attention,
        build=lambda config: Attention(config, window=None),
        fields=ATTENTION_FIELDS,
        flops_per_token=_attention_flops(lambda config, n: _average_keys_seen(None, n)),
        architecture=_attention_architecture,
        tp_split=_attention_heads, tensor_parallel=ATTENTION_TENSOR_PARALLEL, check=_check_kv_heads,
        attention=FULL_ATTENTION, context_parallel=KV_ALL_GATHER,
        activation_bytes_per_token=_attention_activations, kernel_check=check_attention_kernels),
)}


def mixer_kinds(config: ModelConfig) -> list[MixerKind]:
    """The kinds of the layers `config` has, in registry order (each once)."""
    return _kinds_of(config.layer_pattern)


def _kinds_of(symbols: Iterable[str]) -> list[MixerKind]:
    present = set(symbols)
    return [kind for symbol, kind in MIXERS.items() if symbol in present]


def _registered() -> str:
    return ", ".join(f"{kind.symbol} ({kind.description})" for kind in MIXERS.values())


def check_kernels(config: ModelConfig, on_cuda: bool) -> None:
    """Each present mixer's kernel check (MixerKind.kernel_check), at start-up: ConfigError naming the
    field and the fix."""
    for kind in mixer_kinds(config):
        kind.kernel_check(config, on_cuda)


def check_layers(config: ModelConfig, tp: int = 1, cp: int = 1, recompute_chunks: int = 1) -> None:
    """The rules a layer pattern brings, for a validated ModelConfig (config.py cannot know the mixers:
    it is below the model layer): every symbol registered, each present mixer's head counts split
    over `tp` with its own rules, and its context-parallel form taking parallel.cp = `cp` and
    train.recompute_chunks = `recompute_chunks`. Call it wherever a config meets the model."""
    unknown = sorted(set(config.layer_pattern) - set(MIXERS))
    if unknown:
        raise ConfigError(
            f"model.layer_pattern={config.layer_pattern!r} has unknown layer symbol(s) {unknown}; "
            f"use {_registered()}")
    for kind in mixer_kinds(config):
        for name, count in kind.tp_split(config):
            if count % tp:
                raise ConfigError(f"{name}={count} is not divisible by parallel.tp={tp}; choose a tp that "
                                  f"divides it or change the model")
        if kind.check is not None:
            kind.check(config, tp)
    check_context_parallel(config.layer_pattern, cp, recompute_chunks)


def check_context_parallel(symbols: Iterable[str], cp: int = 1, recompute_chunks: int = 1) -> None:
    """Refuse a split of the row that a layer among `symbols` cannot run on, as its kind's
    `context_parallel` declares: over `cp` context-parallel ranks, or into `recompute_chunks` chunks
    run in turn (registered symbols only; check_layers names unknown ones)."""
    for kind in _kinds_of(symbols):
        form = kind.context_parallel
        layers = f"{kind.description} layers ({kind.symbol} in model.layer_pattern)"
        why = f"(context-parallel form: {form.name}): {form.limit}"
        if cp > 1 and not form.across_ranks:
            raise ConfigError(f"parallel.cp={cp}: {layers} cannot run on a row split over context-parallel "
                              f"ranks {why}; use parallel.cp=1, or a model.layer_pattern without "
                              f"{kind.symbol}")
        if recompute_chunks > 1 and not form.across_chunks:
            raise ConfigError(f"train.recompute_chunks={recompute_chunks}: {layers} cannot run in sequence "
                              f"chunks one process runs in turn {why}; use train.recompute_chunks=1, or a "
                              f"model.layer_pattern without {kind.symbol}")


def make_mixer(symbol: str, config: ModelConfig) -> nn.Module:
    kind = MIXERS.get(symbol)
    if kind is None:
        raise ConfigError(f"unknown layer symbol {symbol!r} in model.layer_pattern; use {_registered()}")
    return kind.build(config)


def mixer_flops_per_token(symbol: str, config: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of a `symbol` layer's mixer beyond its matrix parameters."""
    return MIXERS[symbol].flops_per_token(config, seq_len)
