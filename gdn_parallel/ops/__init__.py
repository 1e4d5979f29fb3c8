"""Ops, each with its oracle beside it (DESIGN §1): one public function per op."""
from .attention import attention, attention_reference, masked_attention
from .gated_delta_rule import gated_delta_rule, l2_normalize, summarize_segment
from .rope import apply_rotary, document_ids_from_cu_seqlens, positions_from_cu_seqlens
from .short_conv import causal_conv1d, causal_conv1d_naive

__all__ = ["attention", "attention_reference", "masked_attention", "gated_delta_rule", "l2_normalize",
           "summarize_segment", "apply_rotary", "document_ids_from_cu_seqlens", "positions_from_cu_seqlens",
           "causal_conv1d", "causal_conv1d_naive"]
