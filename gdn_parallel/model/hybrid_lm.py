"""HybridLM: embeddings, a pattern of pre-norm blocks (a token mixer of model/mixers.py + SwiGLU), norm,
lm_head.

Written once for one device; parallelism is applied from gdn_parallel.parallel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import IGNORE_INDEX, ModelConfig
from ..ops.rope import positions_from_cu_seqlens
from .flops import TrainingFlops
from .loss import LinearCrossEntropy, TokenCrossEntropy, lm_head_loss
from .mixers import MIXERS, check_layers, make_mixer
from .mlp import SwiGLU
from .norm import ResidualRMSNorm, RMSNorm, narrower_autocast_dtype
from .sequence import SequenceInfo


class DroppedPart(nn.Module):
    """Stands in, in `model.layers`, for a block another pipeline rank holds (model/build.py)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this block is held by another pipeline rank; run the model through its stages")


def blocks_of(module: nn.Module) -> list:
    """The blocks this process holds of a HybridLM or of a pipeline stage of one: the modules in
    `module.layers` (a list or a ModuleDict keyed by global layer index) but dropped ones."""
    layers = getattr(module, "layers", None)
    if layers is None:
        return []
    values = layers.values() if isinstance(layers, (nn.ModuleDict, dict)) else layers
    return [m for m in values if isinstance(m, nn.Module) and not isinstance(m, DroppedPart)]


def init_linear_weights(module: nn.Module, config: ModelConfig) -> None:
    """Normal(0, initializer_range) for the linears and embeddings inside `module`; the residual
    outputs of its blocks (each mixer's registered output projection, the MLP's down projection)
    scaled by 1/sqrt(2 * n_layers) (GPT-2 style). A_log, dt_bias, convs and norms keep their own init."""
    std = config.initializer_range
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                nn.init.normal_(sub.weight, mean=0.0, std=std)
                if isinstance(sub, nn.Linear) and sub.bias is not None:
                    nn.init.zeros_(sub.bias)
        for block in (m for m in module.modules() if isinstance(m, Block)):
            mixer_out = getattr(block.attn, MIXERS[block.symbol].output_projection)
            for out_proj in (mixer_out, block.mlp.down_proj):
                out_proj.weight.div_(math.sqrt(2 * config.n_layers))


def residual_stream_dtype(config: ModelConfig, autocast_dtype: torch.dtype | None,
                          param_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The residual stream's dtype in a run of these parameters under `autocast_dtype` (None: no
    autocast), as HybridLM.residual_stream makes it; for buffers sized before the first forward."""
    if config.residual_in_fp32 or autocast_dtype is None or autocast_dtype.itemsize >= param_dtype.itemsize:
        return param_dtype
    return autocast_dtype


class Block(nn.Module):
    """x + mixer(norm(x)) = h, then h + mlp(norm(h)): pre-norm, the residual stream x in its own dtype
    (fp32, or the autocast dtype: model.residual_in_fp32). Each norm
    also passes the stream on (and the second one makes h), so that on a GPU the sum, the norm and
    the stream's two gradients meet in one kernel (model/norm.py, ResidualRMSNorm)."""

    def __init__(self, symbol: str, config: ModelConfig):
        super().__init__()
        self.symbol = symbol
        self.attn_norm = ResidualRMSNorm(config.hidden_size, config.norm_eps)
        self.attn = make_mixer(symbol, config)
        self.mlp_norm = ResidualRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.mlp_dim)

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        x, normed = self.attn_norm(x)
        h, normed = self.mlp_norm(x, self.attn(normed, seq))
        return h + self.mlp_branch(normed)

    # A method of its own so that activation checkpointing can wrap it from outside (selective,
    # parallel/checkpointing.py).
    def mlp_branch(self, normed: torch.Tensor) -> torch.Tensor:
        return self.mlp(normed)


@dataclass
class LMOutput:
    loss: torch.Tensor | None = None      # mean over label tokens (sum / num_tokens)
    loss_sum: torch.Tensor | None = None  # summed cross-entropy (global means under parallelism)
    logits: torch.Tensor | None = None    # only when no labels are given
    label_count: torch.Tensor | None = None  # tokens with a label (a 0-d tensor on the model's device)

    @property
    def num_tokens(self) -> int:
        """Tokens with a label, read on the host (a device sync on a GPU)."""
        return 0 if self.label_count is None else int(self.label_count)


class HybridLM(nn.Module):
    criterion: nn.Module  # parallelism swaps in its own (parallel/tensor.py: vocab-parallel cross-entropy)

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        check_layers(config)
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(s, config) for s in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        fused = config.fused_linear_cross_entropy
        if fused is None:  # the default: logits never materialised where memory is tight, a GPU
            fused = torch.cuda.is_available()
        self.criterion = LinearCrossEntropy() if fused else TokenCrossEntropy()
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    def reset_parameters(self) -> None:
        init_linear_weights(self, self.config)

    def sequence_info(self, input_ids, cu_seqlens=None, position_ids=None) -> SequenceInfo:
        if position_ids is None and cu_seqlens is not None:
            total = input_ids.shape[1]
            position_ids = positions_from_cu_seqlens(cu_seqlens, total, input_ids.device).unsqueeze(0)
        return SequenceInfo(cu_seqlens=cu_seqlens, position_ids=position_ids)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                seq: SequenceInfo | None = None) -> LMOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
        seq = seq or self.sequence_info(input_ids, cu_seqlens, position_ids)
        hidden = self.residual_stream(self.embeddings(input_ids))
        for block in self.layers:
            hidden = block(hidden, seq)
        hidden = self.norm(hidden)
        if labels is None:
            return LMOutput(logits=self.lm_head(hidden))
        loss_sum, count = self.loss_sum(hidden, labels)
        return LMOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, label_count=count)

    def residual_stream(self, hidden: torch.Tensor) -> torch.Tensor:
        """The embedding's output as the residual stream: in the autocast dtype where
        model.residual_in_fp32 is off, else (and outside autocast) as it comes."""
        dtype = None if self.config.residual_in_fp32 else narrower_autocast_dtype(hidden)
        return hidden if dtype is None else hidden.to(dtype)

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor):
        """Summed cross-entropy over tokens with a label, and their count as a tensor (for global
        means; read on the host only by whoever needs it: a GPU read is a device sync)."""
        loss = lm_head_loss(self.criterion, self.lm_head, hidden, labels)
        return loss, (labels != IGNORE_INDEX).sum()

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embeddings.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of a row that is one document of `seq_len` tokens (model/flops.py)."""
        return self.training_flops().per_token(seq_len)

    def training_flops(self) -> TrainingFlops:
        """The model's training FLOPs of any packed rows (model/flops.py): 6 per matmul parameter and
        token plus the token mixers' own work."""
        matmul_params = self.num_parameters(exclude_embeddings=True)
        if self.config.tie_word_embeddings:
            matmul_params += self.embeddings.weight.numel()
        return TrainingFlops(self.config, matmul_params)
