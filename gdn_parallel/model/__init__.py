"""The single-device model: layers read like the math; parallelism is applied from outside."""
from .attention import Attention
from .gated_deltanet import GatedDeltaNet, ShortConvolution
from .hybrid_lm import Block, HybridLM, LMOutput
from .loss import IGNORE_INDEX, TokenCrossEntropy
from .mlp import SwiGLU
from .norm import GatedRMSNorm, RMSNorm
from .sequence import SequenceInfo

__all__ = ["Attention", "GatedDeltaNet", "ShortConvolution", "IGNORE_INDEX", "Block", "HybridLM",
           "LMOutput", "TokenCrossEntropy", "SwiGLU", "GatedRMSNorm", "RMSNorm", "SequenceInfo"]
