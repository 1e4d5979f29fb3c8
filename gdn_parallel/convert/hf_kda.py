"""flash-linear-attention's `KDAForCausalLM` folder format (fla 0.6.0): our models of Kimi Delta Attention
layers (K), alone or with softmax attention layers (S, A).

Names: as GatedDeltaNetForCausalLM's (hf_format.py): fla's model is ours under `model.`, `lm_head`
beside it; our KimiDeltaAttention carries fla's names and shapes (q/k/v_proj, q/k/v_conv1d, f_proj.{0,1}
the low-rank decay, b_proj, A_log [HV], dt_bias [HV * K], g_proj.{0,1} the low-rank output gate with its
bias, o_norm, o_proj) and computes what fla's layer computes: decay -exp(A_log) softplus(f + dt_bias)
per value head and key channel, beta sigmoid(b_proj x) (x2 with allow_neg_eigval), q and k L2-normed in
the rule, the output rmsnorm(o) * o_norm.weight * sigmoid(g_proj x).

Config: fla's KDAConfig fields (num_heads, num_v_heads, head_dim, expand_v, allow_neg_eigval, and the
fields every fla model of ours shares: hf_format.shared_hf_fields), the attention layers as `attn`
specs, our whole model config under `gdn_parallel.model`.

Refused on the way out (format_refusals): G layers beside K layers (fla's KDA model has KDA and
Attention layers only, and no fla model holds both delta rules), short-convolution biases (KDABlock builds
its convolutions without), and what fla's Attention cannot compute (hf_format.attention_refusals):
attention without RoPE or with partial RoPE (it rotates every channel of every head, always), output
gates, query/key norms, head sizes other than hidden_size / num_heads. Refused on the way in: fla's
bounded decay (lower_bound, safe_gate), and what hf_format refuses of every fla model
(use_short_conv=false, hidden_act, attnres_block_size, differing attn specs).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import KimiDeltaAttention, mixer_kinds
from .errors import ConvertError
from .hf_format import (
    SHARED_FLA_NAMES,
    attention_refusals,
    fla_attention_kinds,
    fla_linear_kind,
    shared_build_refusals,
    shared_hf_fields,
    shared_model_fields,
    validated,
)

MODEL_TYPE = "kda"
ARCHITECTURE = "KDAForCausalLM"

# What fla 0.6.0's KDAConfig takes for a field a config.json leaves out.
FLA_DEFAULTS = {
    "hidden_size": 2048, "expand_v": 1.0, "use_short_conv": True, "allow_neg_eigval": False,
    "safe_gate": False, "lower_bound": None, "conv_size": 4, "head_dim": 128, "num_heads": 16,
    "num_v_heads": None, "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish",
    "num_hidden_layers": 24, "norm_eps": 1e-6, "attn": None, "tie_word_embeddings": False,
    "initializer_range": 0.02, "vocab_size": 32000, "attnres_block_size": None,
}
# Our fields under another name in fla's config.json (for messages about a folder's fla fields).
FLA_NAMES = {**SHARED_FLA_NAMES, "kda_num_heads": "num_heads", "kda_num_v_heads": "num_v_heads",
             "kda_head_dim": "head_dim", "kda_expand_v": "expand_v",
             "kda_allow_neg_eigval": "allow_neg_eigval"}
# Said after the refusals: trained weights cannot change what they compute, so only another model exports.
KEEP_OURS = ("These weights stay in gdn_parallel's formats: their checkpoint, or one file with gdn-convert "
             "to-torch")


def _kda_kind():
    return fla_linear_kind(KimiDeltaAttention)


# ---------------------------------------------------------------------------- ours -> fla
def format_refusals(model: ModelConfig) -> list[str]:
    """What of `model` (a model with K layers) fla's KDAForCausalLM cannot express (empty: exportable)."""
    fla_kinds = [_kda_kind(), *fla_attention_kinds()]
    refused = [f"{kind.description} layers ({kind.symbol} in model.layer_pattern): fla's KDAForCausalLM has "
               f"Kimi Delta Attention and Attention layers only, and no fla model mixes delta rules; use a "
               f"model.layer_pattern of {_kda_kind().symbol} and attention layers"
               for kind in mixer_kinds(model) if kind not in fla_kinds]
    if model.conv_bias:
        refused.append("model.conv_bias=true: fla's KDAConfig has no conv_bias field (KDABlock builds its "
                       "short convolutions without bias); use model.conv_bias=false")
    return refused + attention_refusals(model)


def hf_config(model: ModelConfig, dtype: torch.dtype, tokenizer: dict | None = None) -> dict:
    """config.json of `model` as fla's KDAForCausalLM (refusals raise ConvertError naming each field);
    `tokenizer` as in hf_format.hf_config."""
    refused = format_refusals(model)
    if refused:
        raise ConvertError("flash-linear-attention's KDAForCausalLM cannot express this model: "
                           + "; ".join(refused) + f". {KEEP_OURS}")
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "num_heads": model.kda_num_heads, "num_v_heads": model.kda_num_v_heads,
        "head_dim": model.kda_head_dim, "expand_v": model.kda_expand_v,
        "allow_neg_eigval": model.kda_allow_neg_eigval,
        "safe_gate": False, "lower_bound": None,     # our decay is unbounded: -exp(A_log) softplus(...)
        **shared_hf_fields(model, dtype, tokenizer),
    }


# ---------------------------------------------------------------------------- fla -> ours
def derived_model_config(hf: dict, where: str) -> ModelConfig:
    """Our model config from a KDA config.json's fla fields alone (refusing what we cannot build)."""
    get = lambda key: hf.get(key, FLA_DEFAULTS[key])  # noqa: E731
    refused = shared_build_refusals(get)
    if get("lower_bound") is not None or get("safe_gate"):
        refused.append(f"safe_gate={get('safe_gate')!r}, lower_bound={get('lower_bound')!r} (fla's bounded "
                       f"decay lower_bound * sigmoid(exp(A_log) (f + dt_bias)); ours is -exp(A_log) "
                       f"softplus(f + dt_bias): set safe_gate false and lower_bound null only if the model "
                       f"was trained so)")
    if refused:
        raise ConvertError(f"{where} describes a model gdn_parallel cannot build: " + "; ".join(refused))
    fields = dict(
        kda_num_heads=get("num_heads"), kda_num_v_heads=get("num_v_heads"), kda_head_dim=get("head_dim"),
        kda_expand_v=get("expand_v"), kda_allow_neg_eigval=get("allow_neg_eigval"),
        **shared_model_fields(hf, get, where, _kda_kind()))
    return validated(fields, where, FLA_NAMES)
