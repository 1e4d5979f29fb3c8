"""The single-device model: layers read like the math; parallelism is applied from outside."""
from .architecture import architecture, architecture_differences
from .attention import Attention
from .build import build_model, part_names
from .flops import TrainingFlops
from .gated_deltanet import NO_WEIGHT_DECAY, GatedDeltaNet, ShortConvolution
from .hybrid_lm import Block, DroppedPart, HybridLM, LMOutput, blocks_of, residual_stream_dtype
from .kda import KimiDeltaAttention
from .loss import TokenCrossEntropy
from .mixers import (
    FULL_ATTENTION,
    MIXERS,
    SLIDING_WINDOW,
    GroupedKVHeads,
    MixerKind,
    TensorParallelLayout,
    check_kernels,
    check_layers,
    make_mixer,
    mixer_flops_per_token,
    mixer_kinds,
)
from .mlp import SwiGLU
from .norm import GatedRMSNorm, RMSNorm
from .sequence import SequenceInfo

__all__ = ["Attention", "GatedDeltaNet", "KimiDeltaAttention", "ShortConvolution", "Block", "DroppedPart",
           "HybridLM", "LMOutput", "TrainingFlops",
           "residual_stream_dtype", "blocks_of", "build_model", "part_names", "architecture",
           "architecture_differences",
           "MIXERS", "MixerKind", "TensorParallelLayout", "GroupedKVHeads", "check_kernels", "check_layers",
           "make_mixer",
           "mixer_kinds", "mixer_flops_per_token", "FULL_ATTENTION", "SLIDING_WINDOW", "TokenCrossEntropy",
           "SwiGLU", "GatedRMSNorm", "RMSNorm", "SequenceInfo", "NO_WEIGHT_DECAY"]
