"""flash-linear-attention's `GatedDeltaNetForCausalLM` folder format (fla 0.6.0, transformers 5), and the
dispatch between it and `KDAForCausalLM` (hf_kda.py): a model with Kimi Delta Attention layers exports
as KDA, any other as GatedDeltaNet; a folder converts by its model_type. What both formats share (names,
attention specs, the MLP and norm fields, the embedded config) is written here once.

Names: fla's model is ours under `model.` (embeddings, layers.<i>.{attn_norm, attn, mlp_norm, mlp},
norm), with `lm_head` beside it; the layers inside carry the same names (our GatedDeltaNet and
Attention were written with fla's). A tied lm_head is not stored (fla ties it to the embeddings).

Config: fla's GatedDeltaNetConfig fields; the attention layers are `attn` specs (`layers`,
`num_heads`, `num_kv_heads`, `qkv_bias`, `window_size`, `rope_theta`), a window of null being full
attention: our S layers are one spec, our A layers another (fla 0.6.0 takes a list). Our whole model
config rides along under `gdn_parallel.model` (transformers keeps unknown keys), so that what fla has
no field for (gdn_chunk_size, the implementations, a null that means 'derived') survives a round
trip; it must agree with the fla fields.

What fla's format cannot express is refused, naming it: attention output gates (fla's Attention has
no g_proj), query/key norms and partial or no RoPE (its model's attention layers have neither),
attention heads not of size hidden_size / num_heads (fla derives it), short-convolution biases
(GatedDeltaNetBlock builds its convolutions without), and on the way in: use_short_conv=false,
hidden_act other than swish, a sigmoid output gate, attention residuals (attnres_block_size),
attention specs that differ in anything but the window, more than one window size.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..config import Config, ConfigError, ModelConfig
from ..model import (
    FULL_ATTENTION,
    MIXERS,
    SLIDING_WINDOW,
    Attention,
    GatedDeltaNet,
    KimiDeltaAttention,
    MixerKind,
    check_layers,
    mixer_kinds,
)
from .errors import ConvertError
from .hf_tokenizer import special_token_ids
from .model_tensors import LM_HEAD, drop_tied_head, require_same_architecture

MODEL_TYPE = "gated_deltanet"
ARCHITECTURE = "GatedDeltaNetForCausalLM"
CONFIG_FILE = "config.json"
EMBEDDED = "gdn_parallel"        # config.json key holding our model config
EMBEDDED_VERSION = 1
FLA_PREFIX = "model."

# What fla 0.6.0's GatedDeltaNetConfig takes for a field a config.json leaves out.
FLA_DEFAULTS = {
    "hidden_size": 2048, "expand_v": 2.0, "use_gate": True, "use_short_conv": True, "allow_neg_eigval": False,
    "conv_size": 4, "head_dim": 256, "num_heads": 6, "num_v_heads": None, "hidden_ratio": 4,
    "intermediate_size": None, "hidden_act": "swish", "num_hidden_layers": 21, "norm_eps": 1e-6, "attn": None,
    "tie_word_embeddings": False, "initializer_range": 0.02, "vocab_size": 32000, "attnres_block_size": None,
    "output_gate_activation": "swish",
}
ATTN_DEFAULTS = {"qkv_bias": False, "window_size": None, "rope_theta": 10000.0}


# An fla model has two layer kinds: its delta-rule layer (GatedDeltaNet, or KDA in KDAForCausalLM: the
# default of every layer) and its Attention layer, whose window (null: full causal) is the spec's. Ours
# map onto them by the registry's facts (the module a mixer builds, which keys its attention sees), never
# by symbol.
def fla_linear_kind(module: type) -> MixerKind:
    """Our mixer built as `module` (GatedDeltaNet, KimiDeltaAttention): an fla model's default layer."""
    return next(kind for kind in MIXERS.values() if kind.module is module)


def _fla_gdn_kind() -> MixerKind:
    return fla_linear_kind(GatedDeltaNet)


def fla_attention_kinds() -> list[MixerKind]:
    return [kind for kind in MIXERS.values() if kind.module is Attention and kind.attention is not None]


def _fla_window(kind: MixerKind, model: ModelConfig) -> int | None:
    return model.window_size if kind.attention == SLIDING_WINDOW else None


def _kind_of_window(window: int | None) -> MixerKind:
    span = FULL_ATTENTION if window is None else SLIDING_WINDOW
    return next(kind for kind in fla_attention_kinds() if kind.attention == span)


def _exports_as_kda(model: ModelConfig) -> bool:
    return fla_linear_kind(KimiDeltaAttention) in mixer_kinds(model)


def _kda_format():
    # Imported when asked for: hf_kda builds on this module's shared pieces, so it imports this one.
    from . import hf_kda
    return hf_kda


# ---------------------------------------------------------------------------- names
def hf_name(name: str) -> str:
    return name if name == LM_HEAD else FLA_PREFIX + name


def to_hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {hf_name(name): tensor for name, tensor in tensors.items()}


def from_hf_tensors(tensors: dict[str, torch.Tensor], model: ModelConfig,
                    where: str) -> dict[str, torch.Tensor]:
    """Our names; names outside fla's model keep theirs (the check against the config names them)."""
    ours = {(name[len(FLA_PREFIX):] if name.startswith(FLA_PREFIX) else name): t
            for name, t in tensors.items()}
    return drop_tied_head(ours, model, where)


# ---------------------------------------------------------------------------- ours -> fla
def format_refusals(model: ModelConfig) -> list[str]:
    """What of `model` the fla format it exports to cannot express (empty: exportable): KDAForCausalLM's
    for a model with Kimi Delta Attention layers (hf_kda.py), GatedDeltaNetForCausalLM's otherwise."""
    if _exports_as_kda(model):
        return _kda_format().format_refusals(model)
    kinds, refused = mixer_kinds(model), []
    fla_kinds = [_fla_gdn_kind(), *fla_attention_kinds()]
    refused += [f"{kind.description} layers ({kind.symbol} in model.layer_pattern): fla's model has "
                f"GatedDeltaNet and Attention layers only" for kind in kinds if kind not in fla_kinds]
    if _fla_gdn_kind() in kinds and model.conv_bias:
        refused.append("model.conv_bias=true: fla's GatedDeltaNetConfig has no conv_bias field "
                       "(GatedDeltaNetBlock builds its short convolutions without bias)")
    return refused + attention_refusals(model)


def attention_refusals(model: ModelConfig) -> list[str]:
    """What fla's Attention layer (the `attn` specs of every fla model) cannot compute of our attention."""
    if not any(kind in mixer_kinds(model) for kind in fla_attention_kinds()):
        return []
    refused = []
    if model.attn_output_gate:
        refused.append("model.attn_output_gate=true: fla's Attention layer has no output gate (g_proj); "
                       "a model with model.attn_output_gate=false exports")
    if model.attn_qk_norm:
        refused.append("model.attn_qk_norm=true: fla's Attention has q_norm and k_norm, but "
                       "fla's models do not turn them on for their attention layers; a model with "
                       "model.attn_qk_norm=false exports")
    if model.rotary_dim != model.attn_dim:
        refused.append(f"model.attn_rotary_dim={model.attn_rotary_dim}: fla's Attention always rotates the "
                       f"whole head ({model.attn_dim} channels); a model with model.attn_rotary_dim: null "
                       f"exports")
    fla_head = model.hidden_size // model.attn_num_heads
    if model.attn_dim != fla_head or model.hidden_size % model.attn_num_heads:
        refused.append(f"attention heads of {model.attn_dim} (model.attn_head_dim): fla's Attention "
                       f"derives its head size as hidden_size / num_heads = {model.hidden_size} / "
                       f"{model.attn_num_heads}; set model.attn_head_dim to null or to that size")
    return refused


def attn_specs(model: ModelConfig):
    """fla's `attn` field of `model`: null, one spec, or a list of specs (one per attention kind)."""
    types = model.layer_types
    common = {"num_heads": model.attn_num_heads, "num_kv_heads": model.num_kv_heads,
              "qkv_bias": model.attn_qkv_bias, "rope_theta": model.rope_theta}
    specs = [{"layers": [i for i, s in enumerate(types) if s == kind.symbol], **common,
              "window_size": _fla_window(kind, model)}
             for kind in fla_attention_kinds() if kind.symbol in types]
    if not specs:
        return None
    return specs[0] if len(specs) == 1 else specs  # a single spec as fla writes it; both kinds as a list


def _plain_number(value: float):
    return int(value) if float(value).is_integer() else value


def hf_config(model: ModelConfig, dtype: torch.dtype, tokenizer: dict | None = None) -> dict:
    """config.json of `model` (refusals raise ConvertError naming every field fla cannot express);
    `tokenizer`: the identity of what made the ids (hf_tokenizer.py), None when unknown. A model with
    Kimi Delta Attention layers is written as KDAForCausalLM (hf_kda.py)."""
    if _exports_as_kda(model):
        return _kda_format().hf_config(model, dtype, tokenizer)
    refused = format_refusals(model)
    if refused:
        raise ConvertError("flash-linear-attention's GatedDeltaNetForCausalLM cannot express this model: "
                           + "; ".join(refused))
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "num_heads": model.gdn_num_heads, "num_v_heads": model.gdn_num_v_heads,
        "head_dim": model.gdn_head_dim,
        "expand_v": model.gdn_expand_v, "use_gate": model.gdn_use_gate,
        "allow_neg_eigval": model.gdn_allow_neg_eigval, "output_gate_activation": "swish",
        **shared_hf_fields(model, dtype, tokenizer),
    }


def shared_hf_fields(model: ModelConfig, dtype: torch.dtype, tokenizer: dict | None) -> dict:
    """The config.json fields every fla causal LM of ours has: sizes, convolution, MLP, norm, head,
    attention specs, fla's defaults for the fields without weights, token ids, dtype, our config."""
    return {
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size, "num_hidden_layers": model.n_layers,
        "conv_size": model.conv_size, "use_short_conv": True, "attn_mode": "chunk",
        "hidden_ratio": _plain_number(model.hidden_ratio), "intermediate_size": model.intermediate_size,
        "hidden_act": "swish", "norm_eps": model.norm_eps, "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.initializer_range, "attn": attn_specs(model),
        "max_position_embeddings": 2048, "use_cache": True, "attnres_block_size": None,
        "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False,
        "use_l2warp": False,
        **special_token_ids(tokenizer),   # null without a tokenizer that names them (byte-level data)
        "dtype": str(dtype).replace("torch.", ""),
        EMBEDDED: {"format_version": EMBEDDED_VERSION, "model": dataclasses.asdict(model),
                   "tokenizer": tokenizer},
    }


# ---------------------------------------------------------------------------- fla -> ours
def read_hf_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise ConvertError(f"{folder} is not a directory: give a Hugging Face model folder (config.json and "
                           f"*.safetensors)")
    if not path.is_file():
        ours = (Path(folder) / ".metadata").is_file() or (Path(folder) / "checkpoints").is_dir()
        ours_note = " (it is a gdn_parallel checkpoint or run: to-hf converts it into one)" if ours else ""
        raise ConvertError(f"{folder} has no {CONFIG_FILE}: not a Hugging Face model folder{ours_note}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConvertError(f"{path} is not valid JSON ({err})") from None
    kda = _kda_format()
    if not isinstance(hf, dict) or hf.get("model_type") not in (MODEL_TYPE, kda.MODEL_TYPE):
        found = hf.get("model_type") if isinstance(hf, dict) else None
        raise ConvertError(f"{path}: model_type {found!r} is neither {MODEL_TYPE!r} nor {kda.MODEL_TYPE!r}; "
                           f"only flash-linear-attention's {ARCHITECTURE} and {kda.ARCHITECTURE} folders "
                           f"(and ours) convert")
    return hf


def attention_layers(hf: dict, n_layers: int, where: str, linear: MixerKind):
    """(our per-layer symbols, the one attention setting (heads, kv heads, qkv bias, rope theta) or None,
    the one sliding window or None) from fla's attn specs; a layer no spec names is `linear`'s."""
    attn = hf.get("attn")
    specs = [] if attn is None else [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ConvertError(f"{where}: attn={attn!r} is neither null, a spec nor a list of specs")
    symbols, settings, windows = [linear.symbol] * n_layers, set(), set()
    for spec in specs:
        if "layers" not in spec or "num_heads" not in spec:
            raise ConvertError(f"{where}: the attn spec {spec} lacks 'layers' or 'num_heads'")
        spec = {**ATTN_DEFAULTS, **spec}
        settings.add((spec["num_heads"], spec.get("num_kv_heads") or spec["num_heads"], spec["qkv_bias"],
                      spec["rope_theta"]))
        window = spec["window_size"]
        if window is not None:
            windows.add(window)
        for layer in spec["layers"]:
            if type(layer) is not int or not 0 <= layer < n_layers or symbols[layer] != linear.symbol:
                raise ConvertError(f"{where}: attn layer {layer!r} is out of [0, {n_layers}) or given twice")
            symbols[layer] = _kind_of_window(window).symbol
    if len(settings) > 1:
        raise ConvertError(f"{where}: the attn specs differ in num_heads / num_kv_heads / qkv_bias / "
                           f"rope_theta ({sorted(settings)}); gdn_parallel has one attention setting for all "
                           f"layers")
    if len(windows) > 1:
        raise ConvertError(f"{where}: the attn specs use several window sizes {sorted(windows)}; "
                           f"gdn_parallel has one (model.window_size) besides full attention")
    setting = settings.pop() if settings else None
    return "".join(symbols), setting, (windows.pop() if windows else None)


def _shortest_tile(types: str) -> str:
    """The shortest pattern that tiles the layer types ('GSGS' -> 'GS'), as our configs write it."""
    n = len(types)
    return next(types[:p] for p in range(1, n + 1) if n % p == 0 and types[:p] * (n // p) == types)


def derived_model_config(hf: dict, where: str) -> ModelConfig:
    """Our model config from fla's fields alone (refusing what we cannot build); a KDA folder's by
    hf_kda.py."""
    if hf.get("model_type") == _kda_format().MODEL_TYPE:
        return _kda_format().derived_model_config(hf, where)
    get = lambda key: hf.get(key, FLA_DEFAULTS[key])  # noqa: E731
    refused = shared_build_refusals(get)
    if get("use_gate") and get("output_gate_activation") not in ("swish", "silu"):
        refused.append(f"output_gate_activation={get('output_gate_activation')!r} (our output gate is swish)")
    if refused:
        raise ConvertError(f"{where} describes a model gdn_parallel cannot build: " + "; ".join(refused))
    fields = dict(
        gdn_num_heads=get("num_heads"), gdn_num_v_heads=get("num_v_heads"),
        gdn_head_dim=get("head_dim"), gdn_expand_v=get("expand_v"), gdn_use_gate=get("use_gate"),
        gdn_allow_neg_eigval=get("allow_neg_eigval"),
        **shared_model_fields(hf, get, where, _fla_gdn_kind()))
    return validated(fields, where, FLA_NAMES)


def shared_build_refusals(get) -> list[str]:
    """What of an fla model's shared fields (`get`: field -> value or fla's default) we cannot build."""
    refused = []
    if not get("use_short_conv"):
        refused.append("use_short_conv=false (our delta-rule layers always have their short convolutions)")
    if get("hidden_act") not in ("swish", "silu"):
        refused.append(f"hidden_act={get('hidden_act')!r} (our MLP is SwiGLU: swish)")
    if get("attnres_block_size") is not None:
        refused.append(f"attnres_block_size={get('attnres_block_size')!r} (attention residuals: extra "
                       f"parameters and another residual stream)")
    return refused


def shared_model_fields(hf: dict, get, where: str, linear: MixerKind) -> dict:
    """Our model fields from the config.json fields every fla model of ours has (sizes, layer types with
    `linear` where no attn spec is, the convolution, MLP, norm and head); `get` as above."""
    n_layers = get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ConvertError(f"{where}: num_hidden_layers={n_layers!r} must be a positive integer")
    types, setting, window = attention_layers(hf, n_layers, where, linear)
    fields = dict(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), n_layers=n_layers,
        layer_pattern=_shortest_tile(types), conv_size=get("conv_size"), conv_bias=False,
        hidden_ratio=get("hidden_ratio") if get("hidden_ratio") is not None else 4,
        intermediate_size=get("intermediate_size"), norm_eps=get("norm_eps"),
        tie_word_embeddings=get("tie_word_embeddings"), initializer_range=get("initializer_range"))
    if setting is not None:
        heads, kv_heads, qkv_bias, rope_theta = setting
        fields.update(attn_num_heads=heads, attn_num_kv_heads=kv_heads, attn_qkv_bias=qkv_bias,
                      rope_theta=rope_theta, attn_head_dim=None)
    if window is not None:
        fields["window_size"] = window
    return fields


# Our fields under another name in fla's config.json (for messages about a folder's fla fields).
SHARED_FLA_NAMES = {"n_layers": "num_hidden_layers", "attn_num_heads": "attn num_heads",
                    "attn_num_kv_heads": "attn num_kv_heads", "window_size": "attn window_size"}
FLA_NAMES = {**SHARED_FLA_NAMES, "gdn_num_heads": "num_heads", "gdn_num_v_heads": "num_v_heads",
             "gdn_head_dim": "head_dim", "gdn_expand_v": "expand_v", "gdn_use_gate": "use_gate",
             "gdn_allow_neg_eigval": "allow_neg_eigval"}


def validated(fields: dict, where: str, fla_names: dict[str, str] | None = None) -> ModelConfig:
    """The checked model config of `fields`; `fla_names` (ours -> config.json's) names the folder's
    fields in the message when they came from fla's."""
    try:
        model = Config.from_dict({"model": fields}).model
        model.validate()
        check_layers(model)
    except ConfigError as err:
        named = [f"model.{ours} is {theirs}" for ours, theirs in (fla_names or {}).items()
                 if f"model.{ours}" in str(err) or f"{ours} " in str(err)]
        hint = f" (in {CONFIG_FILE}: {', '.join(named)})" if named else ""
        raise ConvertError(f"{where} gives a model gdn_parallel cannot build: {err}{hint}") from None
    return model


def source_model_config(hf: dict, where: str) -> ModelConfig:
    """The model a folder holds: our embedded config when present (checked against fla's fields),
    else the one fla's fields describe."""
    derived = derived_model_config(hf, where)
    embedded = hf.get(EMBEDDED)
    if embedded is None:
        return derived
    if not isinstance(embedded, dict) or not isinstance(embedded.get("model"), dict):
        raise ConvertError(f"{where}: the {EMBEDDED} entry is not {{'model': {{...}}}}; delete it to use the "
                           f"fla fields alone")
    ours = validated(embedded["model"], f"{where} ({EMBEDDED}.model)")
    require_same_architecture(derived, ours, "fla fields", f"{EMBEDDED}.model", where=where,
                              fix=f"config.json was edited after export: delete its {EMBEDDED} entry to take "
                                  f"the fla fields")
    return ours
