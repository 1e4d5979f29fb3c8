"""One configuration object for everything: dataclasses, loaded from YAML, overridable from the CLI.

Invalid values fail here, before any model or process group exists, with a ConfigError that names
`section.field`, shows the bad value and says how to fix it. Every field is checked: its type, then
its range rule or its choices, then the rules that tie fields together (`validate` methods).

Each field is declared with `setting(default, help, rule=..., choices=...)`: its help, range and
choices live in the field's metadata, the one source of the validation errors, `gdn-train
--print-config` and `gdn-train --help-config` (gdn_parallel/train/commented_config.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import stat
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

import yaml

# Facts the layers share, each kept once, here at the bottom of the package: the ops, the model, the
# data and the trainers import them, and the config validates its fields against them.
GDN_IMPLS = ("auto", "naive", "chunk", "triton")     # ops.gated_delta_rule
ATTENTION_IMPLS = ("auto", "sdpa", "flex")           # ops.attention
CONV_IMPLS = ("auto", "torch", "triton")             # ops.short_conv
CP_ALGORITHMS = ("relay", "allgather")               # the GDN op's context-parallel algorithms
CP_ATTENTION_SPLITS = ("contiguous", "zigzag")      # whose queries full attention computes under CP
CHECKPOINTING_MODES = ("none", "selective", "full")  # parallel.checkpointing
OFFLOAD_MODES = ("none", "cpu")  # parallel.offload
MAX_HEAD_DIM = 256                                   # GDN head dims the ops (and kernels) take
IGNORE_INDEX = -100                                  # the label of a token without a target
BYTE_VOCAB_SIZE = 256                                # token ids of the byte-level corpora
TRAIN_DTYPES = ("float32", "bfloat16", "float16")
DEVICE_TYPES = ("cpu", "cuda")                # what the training loops place a model on
PP_SCHEDULES = ("1f1b", "interleaved")
LR_SCHEDULES = ("cosine", "wsd", "constant")     # train/schedule.py
DECAY_SHAPES = ("1-sqrt", "linear")             # the wsd schedule's decay
DATA_PARALLEL_MODES = ("fsdp", "ddp")
WANDB_MODES = ("offline", "online", "disabled")
PROGRESS_BAR_MODES = ("auto", "on", "off")
# A *short* convolution: the fused Triton conv unrolls all W taps per token and W^2 in its backward.
# Measured on an H100 (T=8192, D=2048, bf16, forward+backward): W=4 compiles in 6 s and runs in
# 1 ms, W=8 compiles in 41 s and runs 10x slower, W=16 did not compile within 150 s.
MAX_CONV_SIZE = 8


# Fields that were replaced, with what replaced them (a config naming one fails with this).
RENAMED = {"parallel.microbatches": "set train.microbatch_size (sequences per forward/backward) instead; the "
                                    "micro-batches of a step, under pipeline parallelism too, are "
                                    "train.batch_size / train.microbatch_size",
           "train.eval_batches": "set train.eval_rows (validation sequences per evaluation: one set, the "
                                 "same under every layout) instead; eval_batches x batch_size is the number "
                                 "of rows one process evaluated"}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class Rule(NamedTuple):
    """A field's range: `test` on its value (a null optional value is not tested) and what the value
    must be; the error reads `section.field=value <requirement>: <the field's help>`."""
    test: Callable[[Any], bool]
    requirement: str


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """'FIRST,LAST' or 'STEP' -> (first, last); '' -> None. ValueError names what is wrong."""
    text = text.strip()
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ValueError("must be FIRST,LAST (two step numbers, e.g. 10,12), one step (e.g. 10), "
                         "or '' for none")
    first, last = int(parts[0]), int(parts[-1])
    if last < first:
        raise ValueError(f"lists its last step {last} before its first {first}; write FIRST,LAST")
    return first, last


def setting(default: Any = dataclasses.MISSING, help: str = "", *, rule: Rule | None = None,
            choices: tuple = (), factory: Callable[[], Any] | None = None, integer_text: bool = False) -> Any:
    """A config field (dataclasses.field) carrying its help, its range rule and its choices in its
    metadata; `factory` instead of `default` for a mutable default. integer_text: a text field that a
    bare integer may be written for (YAML reads it as a number; the field keeps its digits)."""
    if not help.strip():  # the help is what --print-config, --help-config and the range errors say
        raise TypeError("a config field needs its help: setting(default, help, ...)")
    return field(default=default, default_factory=dataclasses.MISSING if factory is None else factory,
                 metadata={"help": help, "rule": rule, "choices": tuple(choices),
                           "integer_text": integer_text})


def _at_least(low: int, or_null: bool = False) -> Rule:
    return Rule(lambda value: value >= low, f"must be >= {low}" + (" or null" if or_null else ""))


def _number_above(low: float) -> Rule:
    return Rule(lambda value: math.isfinite(value) and value > low, f"must be a number > {low:g}")


def _number_at_least(low: float) -> Rule:
    return Rule(lambda value: math.isfinite(value) and value >= low, f"must be a number >= {low:g}")


def _within(low: float, high: float, bounds: str = "[]", unit: str = "") -> Rule:
    """`bounds`: '[]', '[)' or '(]', the interval's closed ('[', ']') and open ends."""
    def test(value) -> bool:  # NaN fails every comparison
        above = value >= low if bounds[0] == "[" else value > low
        return above and (value <= high if bounds[1] == "]" else value < high)
    what = f"a number of {unit} in" if unit else "in"
    return Rule(test, f"must be {what} {bounds[0]}{low:g}, {high:g}{bounds[1]}")


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


_SEED_RULE = Rule(lambda value: -2 ** 63 <= value < 2 ** 64,
                  "must be an integer in [-2**63, 2**64) (what torch.manual_seed takes)")


def _check_delta_rule_heads(prefix: str, num_heads: int, num_v_heads: int, head_dim: int, expand_v: float,
                            head_v_dim: int, limit_note: str) -> None:
    """The head rules GDN (model.gdn_*) and KDA (model.kda_*) share: grouped value heads, a whole value
    head of at most MAX_HEAD_DIM."""
    if num_v_heads % num_heads:
        raise ConfigError(
            f"model.{prefix}_num_v_heads={num_v_heads} must be a multiple of model.{prefix}_num_heads="
            f"{num_heads} (grouped value heads share q/k heads)")
    value_head = head_dim * expand_v
    if value_head != head_v_dim or head_v_dim < 1:
        raise ConfigError(f"model.{prefix}_expand_v={expand_v} gives a value head of "
                          f"model.{prefix}_head_dim * {prefix}_expand_v = {value_head}; choose "
                          f"{prefix}_expand_v so that this is a whole number >= 1")
    if head_dim > MAX_HEAD_DIM:
        raise ConfigError(f"model.{prefix}_head_dim={head_dim} must be <= {MAX_HEAD_DIM}{limit_note}; use "
                          f"more heads of at most {MAX_HEAD_DIM}")
    if head_v_dim > MAX_HEAD_DIM:
        raise ConfigError(f"model.{prefix}_expand_v={expand_v} gives a value head of "
                          f"model.{prefix}_head_dim * {prefix}_expand_v = {head_v_dim} > {MAX_HEAD_DIM}"
                          f"{limit_note}; lower {prefix}_expand_v or {prefix}_head_dim")


@dataclass
class ModelConfig:
    """The model: model.n_layers blocks of Gated DeltaNet and attention layers (model.layer_pattern),
    each followed by a SwiGLU MLP; flash-linear-attention's names and defaults where they exist."""
    vocab_size: int = setting(256, "the number of token ids (256 for bytes)", rule=_at_least(1))
    hidden_size: int = setting(128, "the model width, e.g. 128", rule=_at_least(1))
    n_layers: int = setting(4, "the number of blocks", rule=_at_least(1))
    layer_pattern: str = setting(
        "GS", "one symbol per layer: G (Gated DeltaNet), K (Kimi Delta Attention), S (sliding-window "
              "attention), A (full causal attention); a shorter pattern is tiled when its length divides "
              "model.n_layers")
    # Gated DeltaNet (G layers)
    gdn_num_heads: int = setting(2, "the number of GDN q/k heads", rule=_at_least(1))
    gdn_num_v_heads: int | None = setting(
        None, "the number of GDN value heads, a multiple of model.gdn_num_heads (null: as many)",
        rule=_at_least(1, or_null=True))
    gdn_head_dim: int = setting(32, "the GDN q/k head size, e.g. 128", rule=_at_least(1))
    gdn_expand_v: float = setting(2.0, "the GDN value head size is gdn_head_dim * gdn_expand_v, e.g. 2.0",
                                  rule=_number_above(0.0))
    gdn_use_gate: bool = setting(True, "gate the GDN output (a SiLU gate from the layer input)")
    gdn_allow_neg_eigval: bool = setting(
        False, "beta in (0, 2) instead of (0, 1): the state transition may have negative eigenvalues")
    gdn_chunk_size: int = setting(64, "the tokens per chunk of the chunked GDN algorithm, e.g. 64",
                                  rule=Rule(_power_of_two, "must be a power of two"))
    gdn_impl: str = setting("auto", "the GDN op: auto (the Triton kernels on CUDA, chunk elsewhere), naive "
                                    "(token by token), chunk (chunked PyTorch) or triton", choices=GDN_IMPLS)
    # Kimi Delta Attention (K layers: Kimi Linear's KDA, fla's KimiDeltaAttention)
    kda_num_heads: int = setting(2, "the number of KDA q/k heads", rule=_at_least(1))
    kda_num_v_heads: int | None = setting(
        None, "the number of KDA value heads, a multiple of model.kda_num_heads (null: as many)",
        rule=_at_least(1, or_null=True))
    kda_head_dim: int = setting(32, "the KDA q/k head size, e.g. 128 (also the rank of the low-rank decay "
                                    "and output-gate projections, times kda_expand_v)", rule=_at_least(1))
    kda_expand_v: float = setting(1.0, "the KDA value head size is kda_head_dim * kda_expand_v, e.g. 1.0",
                                  rule=_number_above(0.0))
    kda_allow_neg_eigval: bool = setting(
        False, "KDA beta in (0, 2) instead of (0, 1): the state transition may have negative eigenvalues")
    kda_chunk_size: int = setting(64, "the tokens per chunk of the chunked KDA algorithm, e.g. 64",
                                  rule=Rule(_power_of_two, "must be a power of two"))
    kda_impl: str = setting("auto", "the KDA op: auto (triton on CUDA, chunk elsewhere), naive (token by "
                                    "token), chunk (chunked PyTorch) or triton (the Triton kernels)",
                            choices=("auto", "naive", "chunk", "triton"))
    conv_size: int = setting(
        4, "the short-convolution width of GDN and KDA layers (the fused kernel unrolls every tap), e.g. 4",
        rule=_within(1, MAX_CONV_SIZE))
    conv_bias: bool = setting(False, "a bias in the short convolutions (GDN and KDA layers)")
    # attention (S and A layers)
    attn_num_heads: int = setting(4, "the number of attention query heads", rule=_at_least(1))
    attn_num_kv_heads: int | None = setting(
        None, "the number of attention key/value heads, dividing model.attn_num_heads (null: as many)",
        rule=_at_least(1, or_null=True))
    attn_head_dim: int | None = setting(
        None, "the attention head size, even for RoPE (null: model.hidden_size / model.attn_num_heads)",
        rule=_at_least(1, or_null=True))
    window_size: int = setting(64, "the keys a sliding-window query sees, itself included, e.g. 64",
                               rule=_at_least(1))
    rope_theta: float = setting(10000.0, "the RoPE base, e.g. 10000.0", rule=_number_above(0.0))
    attn_output_gate: bool = setting(False, "gate the attention output (a sigmoid gate from the layer input)")
    attn_qkv_bias: bool = setting(False, "biases in the attention q, k and v projections")
    attn_qk_norm: bool = setting(
        False, "an RMSNorm over each query and key head before RoPE (one weight of the head size for the "
               "queries, one for the keys; Qwen3 and Qwen3-Next attention)")
    attn_rotary_dim: int | None = setting(
        None, "the channels of each attention head that RoPE rotates, the first ones, even (null: the "
              "whole head; 0: no RoPE, as Kimi Linear's full attention; a quarter of the head: "
              "Qwen3-Next's partial rotary)", rule=_at_least(0, or_null=True))
    attn_impl: str = setting("auto", "the attention op: auto (flex on CUDA, sdpa elsewhere), sdpa or flex",
                             choices=ATTENTION_IMPLS)
    # SwiGLU MLP
    hidden_ratio: float = setting(4.0, "the MLP width over model.hidden_size, e.g. 4.0",
                                  rule=_number_above(0.0))
    intermediate_size: int | None = setting(
        None, "the MLP width (null: derived from model.hidden_ratio, flash-linear-attention's rule)",
        rule=_at_least(1, or_null=True))
    norm_eps: float = setting(1e-6, "the RMSNorm epsilon, e.g. 1e-6", rule=_number_above(0.0))
    residual_in_fp32: bool = setting(
        True, "under bf16/fp16 autocast, keep the residual stream (the blocks' running sum) in fp32; false: "
              "in the autocast dtype, as FSDP2 with bf16 parameters and Megatron-LM by default run it (each "
              "block input kept for the backward takes half the bytes; the stream's adds and norms move "
              "half as much). With train.dtype=float16 keep it true: the stream can outgrow float16's range")
    tie_word_embeddings: bool = setting(False, "the output layer shares the embedding's weights")
    initializer_range: float = setting(0.02, "the std of the initial weights, e.g. 0.02",
                                       rule=_number_above(0.0))
    # The [tokens, vocab] logits are never held at once; the model still returns logits without labels.
    fused_linear_cross_entropy: bool | None = setting(
        None, "compute lm_head + cross-entropy a chunk of tokens at a time "
              "(gdn_kernels.linear_cross_entropy) (null: on where CUDA is available, off elsewhere)")

    @property
    def layer_types(self) -> str:
        pattern = self.layer_pattern
        if len(pattern) == self.n_layers:
            return pattern
        return pattern * (self.n_layers // len(pattern))

    @property
    def num_v_heads(self) -> int:
        return self.gdn_num_v_heads or self.gdn_num_heads

    @property
    def head_v_dim(self) -> int:
        return int(self.gdn_head_dim * self.gdn_expand_v)

    @property
    def kda_v_heads(self) -> int:
        return self.kda_num_v_heads or self.kda_num_heads

    @property
    def kda_head_v_dim(self) -> int:
        return int(self.kda_head_dim * self.kda_expand_v)

    @property
    def num_kv_heads(self) -> int:
        return self.attn_num_kv_heads or self.attn_num_heads

    @property
    def attn_dim(self) -> int:
        return self.attn_head_dim or self.hidden_size // self.attn_num_heads

    @property
    def rotary_dim(self) -> int:
        """The channels of each attention head RoPE rotates (model.attn_rotary_dim, null: all)."""
        return self.attn_dim if self.attn_rotary_dim is None else self.attn_rotary_dim

    @property
    def mlp_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        width = int(self.hidden_size * self.hidden_ratio * 2 / 3)
        return 256 * ((width + 255) // 256)

    def validate(self) -> None:
        _check_fields(self, "model")
        if not self.layer_pattern:
            raise ConfigError("model.layer_pattern='' is empty: give one symbol per layer, e.g. 'GS'")
        # Which symbols exist is the model layer's registry (model/mixers.py: check_layers).
        if len(self.layer_pattern) != self.n_layers and self.n_layers % len(self.layer_pattern):
            raise ConfigError(
                f"model.layer_pattern={self.layer_pattern!r} (length {len(self.layer_pattern)}) neither "
                f"has model.n_layers={self.n_layers} symbols nor tiles it; give a pattern whose length "
                f"divides n_layers or one symbol per layer")
        _check_delta_rule_heads("gdn", self.gdn_num_heads, self.num_v_heads, self.gdn_head_dim,
                                self.gdn_expand_v, self.head_v_dim, limit_note=" (kernel limit)")
        _check_delta_rule_heads("kda", self.kda_num_heads, self.kda_v_heads, self.kda_head_dim,
                                self.kda_expand_v, self.kda_head_v_dim, limit_note="")
        if self.attn_head_dim is None and self.hidden_size % self.attn_num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.attn_num_heads="
                f"{self.attn_num_heads}; change one of them or set model.attn_head_dim")
        if self.attn_num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.attn_num_kv_heads={self.num_kv_heads} must divide model.attn_num_heads="
                f"{self.attn_num_heads} (grouped-query heads); change one of them")
        if self.attn_rotary_dim is not None:
            if self.attn_rotary_dim > self.attn_dim or self.attn_rotary_dim % 2:
                raise ConfigError(f"model.attn_rotary_dim={self.attn_rotary_dim} must be even and at most "
                                  f"the attention head size {self.attn_dim} (RoPE rotates pairs of "
                                  f"channels); choose an even number <= {self.attn_dim}, 0 for no RoPE or "
                                  f"null for all")
        elif self.attn_dim % 2:  # RoPE rotates pairs of channels
            if self.attn_head_dim is not None:
                raise ConfigError(f"model.attn_head_dim={self.attn_head_dim} must be even for RoPE; "
                                  f"choose an even size")
            raise ConfigError(f"the attention head size model.hidden_size / attn_num_heads = "
                              f"{self.attn_dim} must be even for RoPE; set model.attn_head_dim or change "
                              f"model.attn_num_heads")
        if self.intermediate_size is None and self.mlp_dim < 1:
            raise ConfigError(f"model.hidden_ratio={self.hidden_ratio} gives an MLP width of 0 at "
                              f"model.hidden_size={self.hidden_size}; raise it or set "
                              f"model.intermediate_size")


@dataclass
class DataConfig:
    """The training text: where it comes from, which part is held out for validation and how documents
    fill the rows of a batch."""
    source: str = setting(
        "stdlib", "'stdlib' (this Python's standard-library sources: no download, byte vocabulary), a "
                  "directory, a file or a glob of text files, a directory written by gdn-prepare-data or a "
                  "Megatron-LM indexed dataset prefix (path/name_text_document); '' when data.blend names "
                  "the data",
        rule=Rule(lambda value: value == "" or bool(value.strip()), "must name the data"))
    blend: list = setting(
        factory=list, help="several sources read by weight, [[weight, source], ...], each source anything "
                           "data.source takes: source s gets weight_s / sum(weights) of the tokens")
    val_fraction: float = setting(0.02, "the share of documents held out for validation, e.g. 0.02",
                                  rule=_within(0, 1, "[)"))
    seed: int = setting(0, "the seed of the order the training documents are read in, e.g. 0",
                        rule=_SEED_RULE)
    # Prose and Python by default: structured records (.json, .jsonl, .csv, .html) would train on their
    # syntax, so their text goes through gdn-prepare-data (--text-key).
    text_suffixes: str = setting(
        ".txt,.md,.rst,.tex,.py", "the files a directory source reads (case-insensitive), e.g. "
                                  "'.txt,.md,.py', or '*' for every file; binary files (NUL bytes, not "
                                  "UTF-8) are always skipped",
        rule=Rule(lambda value: DataConfig.parse_suffixes(value) is not None,
                  "must be file suffixes separated by commas, each a dot and a name, or '*'"))
    PACKING_MODES = ("documents", "concatenate")   # not a field (no annotation)
    packing: str = setting(
        "documents", "documents: each document its own sequence (cu_seqlens), sequences end at document "
                     "boundaries; concatenate: one stream per row, attention and labels run across them",
        choices=PACKING_MODES)

    def validate(self) -> None:
        # Whether the source yields documents is checked when it is read (gdn_parallel.data), still
        # before the model exists: listing a large corpus twice would slow every start.
        _check_fields(self, "data")
        self._check_blend()

    def _check_blend(self) -> None:
        """data.blend's pairs (weights made floats), and that it and data.source name the data once."""
        example = "e.g. [[0.7, data/web_text_document], [0.3, stdlib]]"
        if not isinstance(self.blend, list):
            raise ConfigError(f"data.blend={self.blend!r} must be a list of [weight, source] pairs, "
                              f"{example}")
        pairs = []
        for index, pair in enumerate(self.blend):
            weight, source = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
                raise ConfigError(f"data.blend[{index}]={pair!r} must be [weight, source] with a weight > 0, "
                                  f"{example}")
            if not isinstance(source, str) or not source.strip():
                raise ConfigError(f"data.blend[{index}]={pair!r} must be [weight, source] with a source as "
                                  f"data.source takes, {example}")
            pairs.append([float(weight), source])
        self.blend = pairs
        if self.blend and self.source:
            raise ConfigError(f"data.blend and data.source={self.source!r} both name the data: set "
                              f"data.source='' (--set \"data.source=''\") to train on the blend, or "
                              f"data.blend=[] to train on data.source")
        if not self.blend and not self.source:
            raise ConfigError("data.source='' names no data: give 'stdlib', text files, a prepared dataset "
                              "or a Megatron-LM prefix, or list weighted sources in data.blend")

    @property
    def suffixes(self) -> tuple[str, ...]:
        """data.text_suffixes as lower-case suffixes; () means every file."""
        parsed = self.parse_suffixes(self.text_suffixes)
        if parsed is None:
            raise ConfigError(_range_error(self, "data", "text_suffixes"))
        return parsed

    @staticmethod
    def parse_suffixes(value: str) -> tuple[str, ...] | None:
        """'.txt, .MD' -> ('.txt', '.md'); '*' -> () (every file); None when malformed."""
        if not isinstance(value, str):
            return None
        items = [item.strip().lower() for item in value.split(",")]
        if items == ["*"]:
            return ()
        good = all(len(item) > 1 and item.startswith(".") and not any(c in item for c in "/\\*?[] \t")
                   for item in items)
        return tuple(dict.fromkeys(items)) if good else None


@dataclass
class TrainConfig:
    """The optimizer, its learning-rate schedule, evaluation, and where and how the run executes."""
    seq_len: int = setting(256, "tokens per sequence: a sequence needs an input token and the label after "
                                "it, e.g. 256", rule=_at_least(2))
    batch_size: int = setting(4, "sequences per optimizer step on each data-parallel replica (the global "
                                 "batch is parallel.dp times this)", rule=_at_least(1))
    microbatch_size: int = setting(
        0, "sequences per forward/backward, dividing train.batch_size: gradient accumulation, and the "
           "pipeline's micro-batches under pipeline parallelism (0: the whole batch)", rule=_at_least(0))
    steps: int = setting(200, "optimizer updates", rule=_at_least(1))
    lr: float = setting(3e-3, "the peak learning rate, e.g. 3e-3", rule=_number_above(0.0))
    min_lr_ratio: float = setting(0.1, "the final learning rate over train.lr, e.g. 0.1", rule=_within(0, 1))
    warmup_steps: int = setting(20, "linear warmup updates (0: none)", rule=_at_least(0))
    lr_schedule: str = setting(
        "cosine", "the learning rate after the warmup (train/schedule.py): cosine: a half cosine from "
                  "train.lr down to min_lr_ratio * lr at the last step; wsd (warmup-stable-decay): lr held, "
                  "then over the last train.decay_fraction of the steps down to min_lr_ratio * lr along "
                  "train.decay_shape; constant: lr to the end (min_lr_ratio unused)", choices=LR_SCHEDULES)
    decay_fraction: float = setting(
        0.2, "the share of train.steps that train.lr_schedule=wsd decays over, at the end, e.g. 0.2",
        rule=_within(0, 1, "(]"))
    # Hägele et al. 2024 found 1-sqrt better than linear.
    decay_shape: str = setting("1-sqrt", "the wsd decay's lr scale at progress p in (0, 1]: 1-sqrt: "
                                         "1 - sqrt(p); linear: 1 - p", choices=DECAY_SHAPES)
    schedule_override: bool = setting(
        False, "allow a resume that changes train.lr_schedule or a setting the saved or new schedule reads "
               "(lr, min_lr_ratio, warmup_steps, steps; wsd: the decay fields): as Megatron's "
               "--override-opt_param-scheduler, the new schedule is evaluated at the resumed step, its LR "
               "there may jump from the saved schedule's (both are printed)")
    weight_decay: float = setting(0.1, "AdamW's weight decay (0: none), e.g. 0.1", rule=_number_at_least(0.0))
    beta1: float = setting(0.9, "AdamW's first-moment decay, e.g. 0.9", rule=_within(0, 1, "[)"))
    beta2: float = setting(0.95, "AdamW's second-moment decay, e.g. 0.95", rule=_within(0, 1, "[)"))
    grad_clip: float = setting(1.0, "the gradient-norm bound (0 turns clipping off), e.g. 1.0",
                               rule=_number_at_least(0.0))
    seed: int = setting(0, "the seed of the initial weights, e.g. 0", rule=_SEED_RULE)
    log_every: int = setting(10, "steps between progress lines", rule=_at_least(1))
    eval_every: int = setting(0, "steps between evaluations (0: only at the end)", rule=_at_least(0))
    eval_rows: int = setting(16, "validation sequences of train.seq_len tokens per evaluation (the same set "
                                 "under any layout)", rule=_at_least(1))
    device: str = setting("auto", "what to train on: auto (CUDA when available, else the CPU), cpu, cuda or "
                                  "cuda:N")
    dtype: str = setting("float32", "the compute dtype on CUDA (autocast; float16 with a loss scaler); the "
                                    "CPU trains in float32", choices=TRAIN_DTYPES)
    threads: int = setting(0, "CPU threads for torch (0: torch's default)", rule=_at_least(0))
    out_dir: str = setting("", "where metrics.jsonl, loss.png and checkpoints go ('': nowhere)")
    # 0: looked up for CUDA devices; none on the CPU (no MFU).
    peak_tflops: float = setting(0.0, "one device's peak TFLOP/s for MFU (0: look it up)",
                                 rule=_number_at_least(0.0))
    memory_check: bool = setting(
        True, "on CUDA, refuse a run whose predicted peak memory exceeds the GPU's by more than the "
              "prediction's error (train/memory_model.py), naming settings that fit; false: only warn")
    activation_checkpointing: str = setting(
        "none", "activations recomputed in the backward to save memory: none; selective: the MLP branches; "
                "full: whole blocks", choices=CHECKPOINTING_MODES)
    recompute_chunks: int = setting(
        1, "with activation_checkpointing=full: each block runs in this many sequence chunks, each its own "
           "checkpoint, so that the backward recomputes and holds one chunk at a time (GDN states and "
           "conv/attention halos handed from chunk to chunk as between context-parallel ranks); 1: whole "
           "blocks", rule=_at_least(1))
    activation_offload: str = setting(
        "none", "where full checkpointing keeps each block's input until its backward: none (the GPU); cpu "
                "(pinned host memory, copied back one block ahead, overlapped with compute)",
        choices=OFFLOAD_MODES)
    activation_offload_blocks: int = setting(
        0, "with activation_offload=cpu: how many of a rank's blocks, the first ones, keep their input on "
           "the host (0: all)", rule=_at_least(0))
    profile_steps: str = setting(
        "", "steps to profile, FIRST,LAST (e.g. 10,12; one step: 10; '': none): a chrome trace and a table "
            "of where their time went (matmul, GDN kernels, conv + norm, ..., GPU idle), over the window "
            "and step by step, each rank's under <train.out_dir>/profile/, the table also printed",
        integer_text=True)
    max_skipped_steps: int = setting(
        3, "non-finite steps in a row (skipped, nothing applied) before the run stops, e.g. 3",
        rule=_at_least(1))
    # Also the wait in joining the process group. A dead or stuck peer then ends the job (or torchrun
    # --max-restarts restarts it) instead of hanging it. It must outlast the longest wait of a healthy
    # job: on CUDA the first steps compile and autotune the Triton kernels (about 3 minutes on an H100)
    # while the other ranks wait in a collective, and a checkpoint save waits for the slowest rank's
    # writes. 600 s leaves room for both and is NCCL's own default; torch's gloo default (30 min) is how
    # long the observed hangs would last.
    collective_timeout_s: float = setting(
        600.0, "how long a rank waits for its peers in one collective before failing; keep it above the "
               "slowest first step (Triton compilation on CUDA: about 3 minutes), e.g. 600",
        rule=_within(1, 86400, unit="seconds"))

    def validate(self) -> None:
        _check_fields(self, "train")
        if self.microbatch_size and self.batch_size % self.microbatch_size:
            raise ConfigError(f"train.microbatch_size={self.microbatch_size} does not divide "
                              f"train.batch_size={self.batch_size}; choose a divisor (or 0: no accumulation)")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} exceeds train.steps={self.steps}; "
                              f"lower train.warmup_steps or raise train.steps")
        if self.warmup_steps > self.longest_warmup:  # (cosine) the run would end at the peak LR
            raise ConfigError(f"train.lr_schedule=cosine: train.warmup_steps={self.warmup_steps} fills all "
                              f"train.steps={self.steps}, leaving no update to decay to min_lr in; lower "
                              f"train.warmup_steps below train.steps (or use train.lr_schedule=constant)")
        if self.lr_schedule == "wsd" and self.warmup_steps + self.decay_steps > self.steps:
            raise ConfigError(f"train.lr_schedule=wsd: train.warmup_steps={self.warmup_steps} plus the "
                              f"decay's round(train.decay_fraction * steps) = {self.decay_steps} steps "
                              f"exceed train.steps={self.steps}; lower train.decay_fraction or "
                              f"train.warmup_steps")
        if self.recompute_chunks > 1 and self.activation_checkpointing != "full":
            raise ConfigError(f"train.recompute_chunks={self.recompute_chunks} splits the blocks full "
                              f"checkpointing recomputes; set train.activation_checkpointing=full (or "
                              f"train.recompute_chunks=1)")
        if self.activation_offload != "none" and self.activation_checkpointing != "full":
            raise ConfigError(f"train.activation_offload={self.activation_offload!r} holds the block inputs "
                              f"that full checkpointing keeps; train.activation_checkpointing="
                              f"{self.activation_checkpointing!r} keeps others: set "
                              f"train.activation_checkpointing=full (or train.activation_offload=none)")
        _check_device(self.device)
        _check_out_dir(self.out_dir)
        self._check_profile_steps()

    def _check_profile_steps(self) -> None:
        try:
            window = parse_profile_steps(self.profile_steps)
        except ValueError as err:
            raise ConfigError(f"train.profile_steps={self.profile_steps!r} {err}") from None
        if window is not None and window[1] >= self.steps:
            raise ConfigError(f"train.profile_steps={self.profile_steps!r} reaches step {window[1]}, but the "
                              f"run's steps are 0..{self.steps - 1} (train.steps={self.steps}); profile "
                              f"earlier steps")

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """train.profile_steps as (first, last), or None."""
        return parse_profile_steps(self.profile_steps)

    @property
    def longest_warmup(self) -> int:
        """The most warmup updates train.steps leaves room for: cosine needs one update after the warmup
        to decay to min_lr in (wsd's decay is checked with its own fields)."""
        return self.steps - 1 if self.lr_schedule == "cosine" else self.steps

    @property
    def decay_steps(self) -> int:
        """Steps of the wsd decay, the last ones of the run."""
        return max(1, round(self.decay_fraction * self.steps))

    @property
    def microbatch_rows(self) -> int:
        """Sequences per forward/backward."""
        return self.microbatch_size or self.batch_size

    @property
    def microbatches(self) -> int:
        """Forward/backward passes per optimizer step (the pipeline's micro-batches under pp)."""
        return self.batch_size // self.microbatch_rows

    def trains_on_cuda(self) -> bool:
        """Whether single-process training will run on a CUDA device."""
        import torch
        if self.device == "auto":
            return torch.cuda.is_available()
        return torch.device(self.device).type == "cuda"


@dataclass
class ParallelConfig:
    """The device mesh pp x dp x cp x tp (innermost last) and how each dimension is applied."""
    tp: int = setting(1, "the tensor-parallel degree (1: off)", rule=_at_least(1))
    pp: int = setting(1, "the pipeline-parallel degree (1: off)", rule=_at_least(1))
    cp: int = setting(1, "the context-parallel degree (1: off)", rule=_at_least(1))
    dp: int = setting(1, "the data-parallel degree (1: off)", rule=_at_least(1))
    sequence_parallel: bool = setting(
        False, "with tp > 1: the norms and residuals between the tensor-parallel layers hold a tp-th of the "
               "sequence each")
    pp_schedule: str = setting("1f1b", "the pipeline schedule: 1f1b (one stage per rank) or interleaved "
                                       "(parallel.virtual_stages per rank)", choices=PP_SCHEDULES)
    virtual_stages: int = setting(1, "pipeline stages per pp rank (1 with the 1f1b schedule)",
                                  rule=_at_least(1))
    data_parallel: str = setting("fsdp", "fsdp (FSDP2 over dp, replicated over cp) or ddp",
                                 choices=DATA_PARALLEL_MODES)
    fsdp_reshard_after_forward: bool = setting(
        True, "with data_parallel=fsdp: free each block's gathered parameters after its forward and gather "
              "them again for its backward and for every micro-batch (true: the least memory), or "
              "gather them once a step and keep them until the last micro-batch's backward (false: the "
              "whole model's parameters in the compute dtype on every rank; one all-gather a block a "
              "step instead of two a micro-batch)")
    cp_algorithm: str = setting(
        "relay", "how the GDN state crosses context-parallel ranks (docs/design.md §2): relay (rank to rank, "
                 "exact) or allgather (one all-gather of segment summaries per layer, for a large cp)",
        choices=CP_ALGORITHMS)
    cp_attention_split: str = setting(
        "contiguous", "which queries each context-parallel rank computes in full causal attention "
                      "(docs/design.md §2): contiguous (its own shard; the last rank does the most work) or "
                      "zigzag (the row cut in 2 x cp blocks, rank r computes blocks r and 2 x cp - 1 - r: "
                      "equal work; the micro-batch row must divide by 2 x parallel.cp)",
        choices=CP_ATTENTION_SPLITS)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def validate(self, model: ModelConfig | None = None, train: TrainConfig | None = None,
                 world_size: int | None = None) -> ParallelConfig:
        _check_fields(self, "parallel")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true splits the sequence over the tensor-parallel "
                              "ranks, and parallel.tp=1 has none; set parallel.tp > 1 or "
                              "parallel.sequence_parallel=false")
        if world_size is not None and self.world_size != world_size:
            raise ConfigError(
                f"parallel.tp * pp * cp * dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = {self.world_size} "
                f"but the job has {world_size} processes; make the product equal the world size")
        if not self.fsdp_reshard_after_forward and self.data_parallel != "fsdp":
            raise ConfigError(f"parallel.fsdp_reshard_after_forward=false is an FSDP2 setting and "
                              f"parallel.data_parallel={self.data_parallel} keeps whole parameters anyway; "
                              f"remove it or set parallel.data_parallel=fsdp")
        if self.pp_schedule == "interleaved" and self.virtual_stages < 2 and self.pp > 1:
            raise ConfigError(f"parallel.virtual_stages={self.virtual_stages}: "
                              f"parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2")
        if self.pp_schedule == "1f1b" and self.virtual_stages != 1:
            raise ConfigError(f"parallel.virtual_stages={self.virtual_stages} needs "
                              f"parallel.pp_schedule=interleaved (1f1b has one stage per rank)")
        if model is not None:
            self._validate_model(model)
        if train is not None:
            self._validate_train(train)
        return self

    def _validate_model(self, model: ModelConfig) -> None:
        tp = self.tp
        # The mixers' head counts, and whether each takes parallel.cp and train.recompute_chunks, are the
        # model layer's rules (model/mixers.py: check_layers(model, tp, cp, recompute_chunks)).
        checks = [("MLP width (model.intermediate_size)", model.mlp_dim),
                  ("model.vocab_size", model.vocab_size)]
        for name, value in checks:
            if value % tp:
                raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp}; choose a tp that "
                                  f"divides it or change the model")
        stages = self.pp * self.virtual_stages
        if model.n_layers < stages:
            raise ConfigError(f"model.n_layers={model.n_layers} < pipeline stages parallel.pp * "
                              f"virtual_stages = {stages}; use fewer stages or more layers")

    def _validate_train(self, train: TrainConfig) -> None:
        if self.pp > 1 and train.microbatches < self.pp:
            raise ConfigError(f"train.microbatch_size={train.microbatch_size} gives {train.microbatches} "
                              f"micro-batch(es) of train.batch_size={train.batch_size}, fewer than the "
                              f"parallel.pp={self.pp} pipeline stages; a schedule needs one per stage: lower "
                              f"train.microbatch_size (or raise train.batch_size)")
        row = train.microbatch_rows * train.seq_len
        if train.recompute_chunks > 1:
            if self.cp_algorithm != "relay":
                raise ConfigError(f"train.recompute_chunks={train.recompute_chunks} hands the GDN state "
                                  f"from chunk to chunk as the relay does; parallel.cp_algorithm="
                                  f"{self.cp_algorithm!r} all-gathers: use relay (or "
                                  f"train.recompute_chunks=1)")
            if self.sequence_parallel:
                raise ConfigError(f"train.recompute_chunks={train.recompute_chunks} with "
                                  f"parallel.sequence_parallel: the tensor-parallel gathers would mix the "
                                  f"chunks' pieces; use one of the two")
            if row % (self.cp * train.recompute_chunks):
                raise ConfigError(f"a micro-batch row of {row} tokens does not split into parallel.cp x "
                                  f"train.recompute_chunks = {self.cp * train.recompute_chunks} equal "
                                  f"chunks; choose a train.recompute_chunks that divides {row // self.cp}")
        if self.cp_attention_split == "zigzag" and self.cp > 1 and row % (2 * self.cp):
            raise ConfigError(f"parallel.cp_attention_split=zigzag cuts the row into 2 x parallel.cp = "
                              f"{2 * self.cp} equal query blocks, and a micro-batch row of train.seq_len * "
                              f"microbatch_size = {row} tokens does not divide by {2 * self.cp}: change "
                              f"train.seq_len or use parallel.cp_attention_split=contiguous")
        split = self.cp * (self.tp if self.sequence_parallel else 1)
        # Divisible and positive, so every rank's shard holds row // split >= 1 tokens.
        if row % split:
            what = ("parallel.cp * parallel.tp (sequence parallel)" if self.sequence_parallel
                    else "parallel.cp")
            raise ConfigError(f"a micro-batch row of train.seq_len * microbatch_size = {row} tokens "
                              f"is not divisible by {what} = {split}; no padding is added: change "
                              f"train.seq_len or the parallel degrees")


@dataclass
class CheckpointConfig:
    """Checkpoints under <train.out_dir>/checkpoints/step_<N>/ (N: completed optimizer steps)."""
    interval: int = setting(0, "optimizer steps between checkpoints (0: only the last step, which is always "
                               "saved)", rule=_at_least(0))
    keep: int = setting(0, "the newest complete checkpoints kept (0: all)", rule=_at_least(0))
    async_save: bool = setting(False, "torch.distributed.checkpoint's async save: training goes on while it "
                                      "writes")
    enabled: bool = setting(True, "write checkpoints (false: none at all, for a run that is never resumed)")
    verify: bool = setting(True, "resume only from a checkpoint with its checksums (checksums.json); false: "
                                 "one without them is loaded unverified, with a line that says so")
    allow_other_run: bool = setting(False, "resume a checkpoint of another run (its run id is not the one "
                                           "<train.out_dir>/run_id.json names) into this out_dir; false: "
                                           "refused, naming both ids. A fresh out_dir (no run_id.json "
                                           "yet) resumes any run's checkpoint without it")

    def validate(self, train: TrainConfig | None = None) -> None:
        _check_fields(self, "checkpoint")
        if train is not None and self.enabled and self.interval and not train.out_dir:
            raise ConfigError(f"checkpoint.interval={self.interval} needs train.out_dir (checkpoints go to "
                              f"<train.out_dir>/checkpoints/); set train.out_dir or checkpoint.interval=0")


@dataclass
class LogConfig:
    """Where metrics go besides the console and <train.out_dir>/metrics.jsonl."""
    tensorboard: bool = setting(False, "event files under <train.out_dir>/tensorboard (needs tensorboard)")
    wandb_project: str = setting("", "a Weights & Biases project ('': no wandb)")
    wandb_mode: str = setting("offline", "offline (no network), online or disabled; W&B's own WANDB_MODE, "
                                         "when set, wins", choices=WANDB_MODES)
    progress_bar: str = setting("auto", "auto: a bar when attached to a terminal, plain lines otherwise; "
                                        "on; off", choices=PROGRESS_BAR_MODES)

    @property
    def wandb_enabled(self) -> bool:
        """A W&B run is made: a project is set and the mode in force is not disabled (W&B's own
        WANDB_MODE when set wins over log.wandb_mode, as its other variables do)."""
        import os
        return bool(self.wandb_project) and (os.environ.get("WANDB_MODE") or self.wandb_mode) != "disabled"

    def validate(self, train: TrainConfig | None = None) -> None:
        """Besides the choices: the backends asked for are installed (checked on every rank, before
        any process group exists) and, given `train`, have a train.out_dir to write to."""
        import importlib.util
        _check_fields(self, "log")
        asked = [("log.tensorboard=true", "tensorboard", "log.tensorboard=false")] if self.tensorboard else []
        if self.wandb_enabled:
            asked.append((f"log.wandb_project={self.wandb_project!r}", "wandb", "log.wandb_project=''"))
        for setting, package, off in asked:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"{setting} needs the {package} package, which is not installed: "
                                  f"pip install {package}, or set {off}")
            if train is not None and not train.out_dir:
                raise ConfigError(f"{setting} needs train.out_dir (the {package} files go under it); set "
                                  f"train.out_dir or {off}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self, world_size: int | None = None) -> Config:
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.parallel.validate(self.model, self.train, world_size)
        self.checkpoint.validate(self.train)
        self.log.validate(self.train)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        return _build(cls, data or {}, "")

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list | None = None,
                  validate: bool = True) -> Config:
        """Load a YAML file, apply `section.field=value` overrides, then validate (unless told not to:
        the CLI adjusts a few fields first)."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} {what_is_at(path)}: give a YAML file (e.g. "
                              f"configs/tiny-cpu.yaml; configs/ has examples)")
        data = _read_yaml(path)
        if data is None:
            raise ConfigError(f"config file {str(path)!r} is empty (or only comments): it would train every "
                              f"default; give the sections to use (model:, train:, ...; configs/ has "
                              f"examples)")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections "
                              f"(model:, data:, train:, parallel:), got {type(data).__name__}")
        config = cls.from_dict(data)
        if overrides:
            config = config.with_overrides(overrides)
        return config.validate() if validate else config

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: list) -> Config:
        """Apply `section.field=value` strings (value parsed as YAML)."""
        data = self.to_dict()
        for item in overrides:
            section, name, value = parse_override(item, data)
            data[section][name] = value
        return Config.from_dict(data)


def parse_override(item: str, sections: dict | None = None) -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, value parsed as YAML); `sections` (a config as a
    dict, defaults if None) says which sections and fields exist."""
    sections = Config().to_dict() if sections is None else sections
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(f"override key {key!r} must be <section>.<field> with section in "
                          f"{sorted(sections)}")
    if key.strip() in RENAMED:
        raise ConfigError(f"{key.strip()} is gone: {RENAMED[key.strip()]}")
    if parts[1] not in sections[parts[0]]:
        raise ConfigError(f"override {key!r}: section {parts[0]!r} has no field {parts[1]!r}; "
                          f"fields: {sorted(sections[parts[0]])}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value {raw!r} is not valid YAML "
                          f"({getattr(err, 'problem', None) or err}); quote it or fix its syntax") from None
    return parts[0], parts[1], value


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (plain YAML keeps the last
    silently: a field set twice in a config would take whichever came last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(None, None, f"the key {key!r} appears twice in one section (first on "
                                    f"line {seen[key] + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_UniqueKeyLoader)   # None: the file holds nothing
    except _DuplicateKey as err:
        raise ConfigError(f"config file {str(path)!r}, line {err.problem_mark.line + 1}: "
                          f"{err.problem}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        raise ConfigError(f"config file {str(path)!r} is not valid YAML at {where}: {err.problem or err}; "
                          f"fix the syntax there (indentation, a missing ':', an unclosed quote or "
                          f"bracket)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}; fix its syntax") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({err}); save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror}") from None


@functools.cache
def _field_types(cls) -> dict:
    return get_type_hints(cls)


def _check_fields(obj, section: str) -> None:
    """Every field's type (as when read from YAML, so configs built in code are held to the same
    rules), then its range rule or its choices, as its declaration (`setting`) gives them."""
    section_class: type = type(obj)  # not type[Any], which mypy takes for unhashable (functools.cache)
    hints = _field_types(section_class)
    for f in fields(obj):
        setattr(obj, f.name, _coerce(getattr(obj, f.name), hints[f.name], f"{section}.{f.name}",
                                     f.metadata.get("choices", ())))
    for f in fields(obj):
        value, rule, choices = getattr(obj, f.name), f.metadata.get("rule"), f.metadata.get("choices", ())
        if rule is not None and value is not None and not rule.test(value):
            raise ConfigError(_range_error(obj, section, f.name))
        if choices and value not in choices:
            raise ConfigError(f"{section}.{f.name}={value!r} is not supported; choose one of {choices} "
                              f"({f.metadata['help']})")


def _range_error(obj, section: str, name: str) -> str:
    """The message for a value outside its field's range rule."""
    declared = next(f for f in fields(obj) if f.name == name)
    return (f"{section}.{name}={getattr(obj, name)!r} {declared.metadata['rule'].requirement}: "
            f"{declared.metadata['help']}")


def _check_device(name: str) -> None:
    """The form of train.device; whether a CUDA device is present is checked when training starts."""
    if name == "auto":
        return
    import torch
    try:
        device_type = torch.device(name).type
    except (RuntimeError, ValueError):
        device_type = None
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"train.device={name!r} is not a device to train on; use 'auto', 'cpu', 'cuda' or "
                          f"'cuda:N'")


def _check_out_dir(out_dir: str) -> None:
    """train.out_dir must be a writable directory or one that can be created; checked without
    creating anything (training creates it)."""
    if not out_dir:
        return
    path = Path(out_dir).absolute()
    try:
        existing = path
        while not existing.exists():  # the nearest existing ancestor: mkdir(parents=True) makes the rest
            existing = existing.parent
        is_dir = existing.is_dir()
    except OSError as err:
        raise ConfigError(f"train.out_dir={out_dir!r} cannot be checked ({err.strerror}: {err.filename}); "
                          f"choose a directory you can write") from None
    if not is_dir:
        where = "is an existing file" if existing == path else f"lies under the file {str(existing)!r}"
        raise ConfigError(f"train.out_dir={out_dir!r} {where}; choose a directory path (or '' to write "
                          f"nothing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = ("is not writable" if existing == path
                else f"cannot be created: {str(existing)!r} is not writable")
        raise ConfigError(f"train.out_dir={out_dir!r} {what}; choose a directory you can write (or '' to "
                          f"write nothing)")


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def what_is_at(path: str | Path) -> str:
    """Why `path` is no regular file, in words for a message ("does not exist", "is a directory",
    "is a character device, not a regular file", ...), for a path that was expected to be a file."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        return "is a broken symbolic link" if path.is_symlink() else "does not exist"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    kind = next((name for test, name in _KINDS if test(mode)), None)
    return f"is {kind}, not a regular file" if kind else "is not a regular file"


def creation_problem(path: str | Path) -> str | None:
    """Why the file or directory `path` could not be created, or None when it can: the nearest existing
    ancestor must be a directory in which an entry can be made. Probed by making (and removing) one,
    since os.access passes root where a read-only or virtual file system (/proc) refuses it."""
    existing = Path(path).absolute().parent
    try:
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            return f"{str(existing)!r} is a file, not a directory"
        Path(tempfile.mkdtemp(prefix=".gdn-write-probe-", dir=existing)).rmdir()
    except OSError as err:
        return f"nothing can be created in {str(existing)!r} ({err.strerror or err})"
    return None


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = _field_types(cls)
    declared = {f.name: f for f in fields(cls)}
    known = set(declared)
    unknown = sorted(set(data) - known)
    for name in unknown:
        if prefix + name in RENAMED:
            raise ConfigError(f"{prefix}{name} is gone: {RENAMED[prefix + name]}")
    if unknown:
        raise ConfigError(f"unknown field(s) {[prefix + u for u in unknown]}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{prefix}{name}.")
        else:
            metadata = declared[name].metadata
            if metadata.get("integer_text") and isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            kwargs[name] = _coerce(value, hint, prefix + name, metadata.get("choices", ()))
    return cls(**kwargs)


def _coerce(value, hint, name: str, choices: tuple = ()):
    """`value` as the type `hint` asks (a YAML 1.1 reading undone where it misread the text), else a
    ConfigError naming `name`."""
    optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} may not be null; give a value")
    base = [a for a in get_args(hint) if a is not type(None)][0] if optional else hint
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be true or false")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}={value!r} must be an integer")
        return value
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={value!r} must be a number")
        return float(value)
    if base is str:
        # YAML 1.1 reads a bare on/off (also no, true) as a boolean: a field whose choices are on and off
        # takes it back.
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            return "on" if value else "off"
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be a string")
        return value
    return value
