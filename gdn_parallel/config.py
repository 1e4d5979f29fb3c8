"""One configuration object for everything: dataclasses, loaded from YAML, overridable from the CLI.

Invalid values fail here, before any model or process group exists, with a message that names the
field and says how to fix it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import yaml

LAYER_SYMBOLS = {"G": "gated deltanet", "S": "sliding-window attention", "A": "full causal attention"}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    n_layers: int = 4
    # One symbol per layer (G = GatedDeltaNet, S = sliding-window attention, A = full attention);
    # a shorter pattern is tiled when it divides n_layers.
    layer_pattern: str = "GS"
    # Gated DeltaNet (flash-linear-attention's names and defaults where they exist)
    gdn_num_heads: int = 2
    gdn_num_v_heads: Optional[int] = None
    gdn_head_dim: int = 32
    gdn_expand_v: float = 2.0
    gdn_use_gate: bool = True
    gdn_allow_neg_eigval: bool = False
    gdn_chunk_size: int = 64
    gdn_impl: str = "auto"
    conv_size: int = 4
    conv_bias: bool = False
    # attention (S and A layers)
    attn_num_heads: int = 4
    attn_num_kv_heads: Optional[int] = None
    attn_head_dim: Optional[int] = None
    window_size: int = 64
    rope_theta: float = 10000.0
    attn_output_gate: bool = False
    attn_qkv_bias: bool = False
    attn_impl: str = "auto"
    # SwiGLU MLP; intermediate_size defaults to flash-linear-attention's rule
    hidden_ratio: float = 4.0
    intermediate_size: Optional[int] = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # lm_head + cross-entropy a chunk of tokens at a time (gdn_kernels.linear_cross_entropy): the
    # [tokens, vocab] logits are never held at once. Logits are still returned without labels.
    fused_linear_cross_entropy: bool = False

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
    def num_kv_heads(self) -> int:
        return self.attn_num_kv_heads or self.attn_num_heads

    @property
    def attn_dim(self) -> int:
        return self.attn_head_dim or self.hidden_size // self.attn_num_heads

    @property
    def mlp_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        width = int(self.hidden_size * self.hidden_ratio * 2 / 3)
        return 256 * ((width + 255) // 256)

    def validate(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "n_layers", "gdn_num_heads", "gdn_head_dim",
                  "attn_num_heads", "window_size", "conv_size", "gdn_chunk_size")
        if not self.layer_pattern:
            raise ConfigError("model.layer_pattern is empty: give one symbol per layer, e.g. 'GS'")
        unknown = sorted(set(self.layer_pattern) - set(LAYER_SYMBOLS))
        if unknown:
            raise ConfigError(
                f"model.layer_pattern={self.layer_pattern!r} has unknown layer symbol(s) {unknown}; "
                f"use {', '.join(f'{k} ({v})' for k, v in LAYER_SYMBOLS.items())}")
        if len(self.layer_pattern) != self.n_layers and self.n_layers % len(self.layer_pattern):
            raise ConfigError(
                f"model.layer_pattern={self.layer_pattern!r} (length {len(self.layer_pattern)}) neither "
                f"has model.n_layers={self.n_layers} symbols nor tiles it; give a pattern whose length "
                f"divides n_layers or one symbol per layer")
        if self.num_v_heads % self.gdn_num_heads:
            raise ConfigError(
                f"model.gdn_num_v_heads={self.num_v_heads} must be a multiple of model.gdn_num_heads="
                f"{self.gdn_num_heads} (grouped value heads share q/k heads)")
        if self.head_v_dim != self.gdn_head_dim * self.gdn_expand_v:
            raise ConfigError(f"model.gdn_head_dim * model.gdn_expand_v = "
                              f"{self.gdn_head_dim * self.gdn_expand_v} must be a whole number")
        if self.gdn_head_dim > 256 or self.head_v_dim > 256:
            raise ConfigError(f"model.gdn_head_dim={self.gdn_head_dim} and head_dim*expand_v="
                              f"{self.head_v_dim} must be <= 256 (kernel limit)")
        if self.attn_head_dim is None and self.hidden_size % self.attn_num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.attn_num_heads="
                f"{self.attn_num_heads}; change one of them or set model.attn_head_dim")
        if self.attn_num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.attn_num_heads={self.attn_num_heads} must be a multiple of "
                f"model.attn_num_kv_heads={self.num_kv_heads}")
        if self.attn_dim % 2:
            raise ConfigError(f"attention head dim {self.attn_dim} must be even for RoPE; "
                              f"set model.attn_head_dim or change model.attn_num_heads")
        if not isinstance(self.fused_linear_cross_entropy, bool):
            raise ConfigError(f"model.fused_linear_cross_entropy={self.fused_linear_cross_entropy!r} "
                              f"must be true or false")
        for name, allowed in (("gdn_impl", ("auto", "naive", "chunk", "triton")),
                              ("attn_impl", ("auto", "sdpa", "flex"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}; choose one of {allowed}")


@dataclass
class DataConfig:
    # "stdlib": the bytes of this Python's standard-library sources (no download), byte vocabulary;
    # otherwise a directory or glob of text files read the same way.
    source: str = "stdlib"
    val_fraction: float = 0.02
    seed: int = 0

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")


@dataclass
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 4          # sequences per step, packed into one varlen row
    steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0          # 0: evaluate only at the end
    eval_batches: int = 4
    device: str = "auto"
    dtype: str = "float32"
    threads: int = 0             # 0: leave torch's default
    out_dir: str = ""            # where metrics.jsonl and loss.png go; empty: nowhere
    peak_tflops: float = 0.0     # per device, for MFU; 0: look up CUDA devices, none on CPU
    activation_checkpointing: str = "none"   # "full": recompute each block in the backward

    def validate(self) -> None:
        _positive(self, "seq_len", "batch_size", "steps", "lr", "log_every", "eval_batches")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps="
                              f"{self.steps}]")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"train.dtype={self.dtype!r}; choose float32, bfloat16 or float16")
        if self.activation_checkpointing not in ("none", "full"):
            raise ConfigError(f"train.activation_checkpointing={self.activation_checkpointing!r}; choose "
                              f"'none' or 'full' (recompute every block in the backward)")


@dataclass
class ParallelConfig:
    """The device mesh pp x dp x cp x tp (innermost last) and how each dimension is applied."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"          # 1f1b | interleaved
    microbatches: int = 1
    virtual_stages: int = 1            # pipeline stages per pp rank (interleaved schedule)
    data_parallel: str = "fsdp"        # fsdp (FSDP2 over dp, replicated over cp) | ddp
    cp_algorithm: str = "relay"        # relay | allgather (DESIGN §2)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def validate(self, model: Optional[ModelConfig] = None, train: Optional["TrainConfig"] = None,
                 world_size: Optional[int] = None) -> "ParallelConfig":
        for name in ("tp", "pp", "cp", "dp", "microbatches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        for name, allowed in (("pp_schedule", ("1f1b", "interleaved")), ("data_parallel", ("fsdp", "ddp")),
                              ("cp_algorithm", ("relay", "allgather"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"parallel.{name}={getattr(self, name)!r}; choose one of {allowed}")
        if world_size is not None and self.world_size != world_size:
            raise ConfigError(
                f"parallel.tp * pp * cp * dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = {self.world_size} but "
                f"the job has {world_size} processes; make the product equal the world size")
        if self.pp_schedule == "interleaved" and self.virtual_stages < 2 and self.pp > 1:
            raise ConfigError("parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2")
        if self.pp_schedule == "1f1b" and self.virtual_stages != 1:
            raise ConfigError(f"parallel.virtual_stages={self.virtual_stages} needs "
                              f"parallel.pp_schedule=interleaved (1f1b has one stage per rank)")
        if self.pp > 1 and self.microbatches < self.pp:
            raise ConfigError(f"parallel.microbatches={self.microbatches} < parallel.pp={self.pp}: a pipeline "
                              f"schedule needs at least one microbatch per stage; raise microbatches")
        if model is not None:
            self._validate_model(model)
        if train is not None:
            self._validate_train(train)
        return self

    def _validate_model(self, model: ModelConfig) -> None:
        tp = self.tp
        checks = [("model.gdn_num_heads", model.gdn_num_heads), ("model.gdn_num_v_heads", model.num_v_heads),
                  ("model.attn_num_heads", model.attn_num_heads), ("MLP width (model.intermediate_size)",
                                                                    model.mlp_dim),
                  ("model.vocab_size", model.vocab_size)]
        for name, value in checks:
            if value % tp:
                raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp}; choose a tp that "
                                  f"divides it or change the model")
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ConfigError(f"model.attn_num_kv_heads={model.num_kv_heads} and parallel.tp={tp}: one must "
                              f"divide the other (KV heads are split, or replicated when fewer than tp)")
        stages = self.pp * self.virtual_stages
        if model.n_layers < stages:
            raise ConfigError(f"model.n_layers={model.n_layers} < pipeline stages parallel.pp * "
                              f"virtual_stages = {stages}; use fewer stages or more layers")

    def _validate_train(self, train: "TrainConfig") -> None:
        if train.batch_size % self.microbatches:
            raise ConfigError(f"train.batch_size={train.batch_size} is not divisible by parallel.microbatches="
                              f"{self.microbatches}")
        row = train.batch_size // self.microbatches * train.seq_len
        split = self.cp * (self.tp if self.sequence_parallel else 1)
        if row % split:
            what = "parallel.cp * parallel.tp (sequence parallel)" if self.sequence_parallel else "parallel.cp"
            raise ConfigError(f"a microbatch row of train.seq_len * batch_size / microbatches = {row} tokens "
                              f"is not divisible by {what} = {split}; no padding is added")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self, world_size: Optional[int] = None) -> "Config":
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.parallel.validate(self.model, self.train, world_size)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        return _build(cls, data or {}, "")

    @classmethod
    def from_yaml(cls, path: Union[str, Path], overrides: Optional[list] = None) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; see configs/ for examples")
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        config = cls.from_dict(data)
        if overrides:
            config = config.with_overrides(overrides)
        return config.validate()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: list) -> "Config":
        """Apply `section.field=value` strings (value parsed as YAML)."""
        data = self.to_dict()
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like section.field=value")
            key, raw = item.split("=", 1)
            parts = key.strip().split(".")
            if len(parts) != 2 or parts[0] not in data:
                raise ConfigError(f"override key {key!r} must be <section>.<field> with section in "
                                  f"{sorted(data)}")
            if parts[1] not in data[parts[0]]:
                raise ConfigError(f"override {key!r}: section {parts[0]!r} has no field {parts[1]!r}; "
                                  f"fields: {sorted(data[parts[0]])}")
            data[parts[0]][parts[1]] = yaml.safe_load(raw)
        return Config.from_dict(data)


def _positive(obj, *names):
    section = {ModelConfig: "model", TrainConfig: "train", ParallelConfig: "parallel"}.get(type(obj), "config")
    for name in names:
        value = getattr(obj, name)
        if value is None or value <= 0:
            raise ConfigError(f"{section}.{name}={value} must be positive")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown field(s) {[prefix + u for u in unknown]}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, prefix + name)
    return cls(**kwargs)


def _coerce(value, hint, name):
    optional = get_origin(hint) is Union and type(None) in get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} may not be null")
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
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be a string")
        return value
    return value
