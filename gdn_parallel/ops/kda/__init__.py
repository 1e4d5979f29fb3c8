"""Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

with g_t in R^K (<= 0) per value head and token. The state is [K, V] per head, as the gated delta
rule's (docs/design.md §1), which is KDA with g equal across the channels. One public function per
op, with its oracle (`naive`) beside the PyTorch chunked form (`chunk`) and the context-parallel form
(cp.py: the gated delta rule's state relay and summary all-gather, docs/design.md §2); the segment
summary is what a rank exchanges under the all-gather. impl="triton" runs the Triton chunk kernels
(gdn_kernels.kda), under context parallelism too (cp.py).
"""
from __future__ import annotations

import torch
from gdn_kernels.chunk_layout import build_layout

from ...comm import CPContext
from ..gated_delta_rule import l2_normalize
from ..gated_delta_rule.cp import check_cp_call
from ..gated_delta_rule.inputs import check_chunk_size, check_rule_inputs, check_sequences, state_dtype
from ..triton_dispatch import auto_uses_triton, check_triton_input
from ..validation import check_cu_seqlens
from .chunk import chunk_kda
from .cp import cp_kimi_delta_attention, cp_kimi_delta_attention_triton, triton_takes_cp
from .gates import activate_kda_gates, check_kda_gate_args
from .naive import naive_documents
from .summary import document_summaries

__all__ = ["kimi_delta_attention", "summarize_segment", "KDA_IMPLS"]

KDA_IMPLS = ("auto", "naive", "chunk", "triton")


def kimi_delta_attention(q, k, v, g, beta, *, scale: float | None = None,
                         initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                         cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                         impl: str = "auto", chunk_size: int = 64, cp: CPContext | None = None,
                         decay_params=None, beta_activation: str | None = None):
    """Run Kimi Delta Attention over [B, T] tokens (or one packed row of documents).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head j reads q/k head
    j // (HV // H)); g (log decay per key channel, <= 0): [B, T, HV, K]; beta: [B, T, HV];
    initial_state: [N, HV, K, V] with N = B, or the number of documents when `cu_seqlens` [N + 1]
    describes a packed row (B = 1; the state restarts at each document). scale defaults to K^-1/2.
    impl: "naive" (the float64 token loop), "chunk" (PyTorch, chunks of `chunk_size`), "triton" (the
    Triton kernels: CUDA tensors, or CPU under TRITON_INTERPRET=1; fp32/fp16/bf16, chunks of 64) or
    "auto" (triton for CUDA tensors of those dtypes, else chunk). Returns (o [B, T, HV, V] in v's
    dtype, final_state [N, HV, K, V] fp32 (float64 for float64 inputs) or None).

    Context parallelism: with `cp` (the row's plan, `gdn_parallel.comm.CPContext`; give no
    `cu_seqlens`) the tensors are this rank's contiguous slice of one packed row, as for
    gated_delta_rule: `initial_state` holds the documents that start on this rank and the final states
    returned are those of the documents that end on it (docs/design.md §2).

    Activations (Kimi Linear's layer): with `decay_params` = (A_log [HV], dt_bias [HV * K]), g holds the
    logits f of g = -exp(A_log) * softplus(f + dt_bias); with `beta_activation` "sigmoid" or "2sigmoid"
    (allowing negative eigenvalues), beta holds logits.
    """
    B, T, H, K, HV, V = _check_inputs(q, k, v, g, beta, initial_state, impl, chunk_size,
                                      g_is_decay=decay_params is None)
    check_kda_gate_args(decay_params, beta_activation, HV, K)
    if cp is not None:
        check_cp_call(q, cu_seqlens, cp, impl)
    else:
        cu_seqlens = check_sequences(cu_seqlens, initial_state, B, T)
    scale = K ** -0.5 if scale is None else scale
    g, beta = activate_kda_gates(g, beta, decay_params, beta_activation)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    impl = _resolve_impl(impl, v)
    if impl == "triton" and cp is None:  # the kernels read grouped q/k heads in place
        return _triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    on_kernels = impl == "triton" and _check_triton_chunk(v, chunk_size) is not None
    if cp is not None and on_kernels and triton_takes_cp(k, v, cp):
        return cp_kimi_delta_attention_triton(
            q, k, v, g, beta, scale=scale, cp=cp, initial_state=initial_state,
            output_final_state=output_final_state)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if cp is not None:  # the PyTorch chunk form (or the all-gather of heads too wide for the kernels)
        return cp_kimi_delta_attention(q, k, v, g, beta, scale=scale, cp=cp, chunk_size=chunk_size,
                                       initial_state=initial_state, output_final_state=output_final_state)
    if impl == "naive":
        o, final = naive_documents(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    else:
        lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
        layout = build_layout(lengths, chunk_size, v.device)
        q_f, k_f, v_f, g_f, beta_f = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        o, final = chunk_kda(q_f, k_f, v_f, g_f, beta_f, scale=scale, layout=layout,
                             initial_state=initial_state)
        o = o.reshape(B, T, HV, V)
    return o, (final.to(state_dtype(v)) if output_final_state else None)


def summarize_segment(k, v, g, beta, *, cu_seqlens: torch.Tensor | None = None,
                      use_qk_l2norm: bool = False, chunk_size: int = 64):
    """Affine summary of a segment per sequence and value head: S_out = M @ S_in + S_loc.

    k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]. Returns M [N, HV, K, K]
    (the transition) and S_loc [N, HV, K, V] (the final state from a zero start), fp32 (float64 for
    float64 inputs). Chunk-parallel: all chunk transitions at once, then a log-depth pairwise fold.
    """
    B, T, H, K, HV, V = _check_inputs(k, k, v, g, beta, None, "chunk", chunk_size)
    cu_seqlens = check_cu_seqlens(cu_seqlens, B, T)
    if use_qk_l2norm:
        k = l2_normalize(k)
    if HV != H:
        k = k.repeat_interleave(HV // H, dim=2)
    lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
    layout = build_layout(lengths, chunk_size, v.device)
    dtype = state_dtype(v)
    k_f, v_f, g_f, beta_f = (x.reshape(B * T, *x.shape[2:]).to(dtype) for x in (k, v, g, beta))
    return document_summaries(k_f, v_f, g_f, beta_f, layout=layout)


def _resolve_impl(impl: str, x: torch.Tensor) -> str:
    if impl != "auto":
        return impl
    return "triton" if auto_uses_triton(x, "kda") else "chunk"


def _check_triton_chunk(v, chunk_size: int):
    """impl='triton': the kernels import and take these inputs and this chunk length; returns them."""
    kernels = check_triton_input(v, "kda", "chunk")
    if chunk_size != kernels.CHUNK:
        raise ValueError(f"impl='triton' runs chunks of {kernels.CHUNK} tokens, got chunk_size={chunk_size}; "
                         f"leave chunk_size at its default or use impl='chunk'")
    return kernels


def _triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    """q, k normalised by the caller, grouped heads not expanded; g and beta activated."""
    kernels = _check_triton_chunk(v, chunk_size)
    o, final = kernels.triton_kimi_delta_attention(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                   output_final_state=output_final_state,
                                                   cu_seqlens=cu_seqlens)
    return o, (final.to(state_dtype(v)) if output_final_state else None)


def _check_inputs(q, k, v, g, beta, initial_state, impl, chunk_size, g_is_decay=True):
    dims = check_rule_inputs(q, k, v, g, beta, initial_state, decay_per_channel=True, g_is_decay=g_is_decay,
                             decay_meaning="alpha = exp(g) in (0, 1]")
    if impl not in KDA_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {KDA_IMPLS}")
    check_chunk_size(chunk_size)
    return dims
