"""The single-device model: layers read like the math; parallelism is applied from outside."""
from .attention import Attention
from .build import build_model, part_names
from .gated_deltanet import GatedDeltaNet, ShortConvolution
from .hybrid_lm import Block, DroppedPart, HybridLM, LMOutput, blocks_of, mixer_flops_per_token
from .loss import TokenCrossEntropy
from .mlp import SwiGLU
from .norm import GatedRMSNorm, RMSNorm
from .sequence import SequenceInfo

__all__ = ["Attention", "GatedDeltaNet", "ShortConvolution", "Block", "DroppedPart", "HybridLM", "LMOutput",
           "blocks_of", "build_model", "part_names",
           "mixer_flops_per_token", "TokenCrossEntropy", "SwiGLU", "GatedRMSNorm", "RMSNorm", "SequenceInfo"]
