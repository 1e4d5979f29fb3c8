"""Ops, each with its oracle beside it (docs/design.md §1): one public function per op, whose folder
also holds its single-device forms and its context-parallel form (an op takes `cp`, the row's plan)."""
from .attention import attention, attention_reference, masked_attention
from .gated_delta_rule import gated_delta_rule, l2_normalize, summarize_segment
from .rope import apply_rotary, document_ids_from_cu_seqlens, positions_from_cu_seqlens
from .short_conv import causal_conv1d, causal_conv1d_naive
from .swiglu import swiglu_down, swiglu_down_reference

__all__ = ["attention", "attention_reference", "masked_attention", "gated_delta_rule", "l2_normalize",
           "summarize_segment", "apply_rotary", "document_ids_from_cu_seqlens", "positions_from_cu_seqlens",
           "causal_conv1d", "causal_conv1d_naive", "swiglu_down", "swiglu_down_reference"]
