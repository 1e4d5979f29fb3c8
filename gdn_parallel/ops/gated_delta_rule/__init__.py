"""Gated delta rule: one public function per op, with its oracle (`naive`) beside the PyTorch chunked
form (`chunk`), on CUDA the Triton kernels (`triton`), and the context-parallel form (cp.py). See
docs/design.md §1-2."""
from __future__ import annotations

import torch
from gdn_kernels.chunk_layout import build_layout

from ...comm import CPContext
from ...config import GDN_IMPLS
from ..triton_dispatch import auto_uses_triton, check_triton_input, imported_kernel
from ..validation import check_cu_seqlens
from .chunk import chunk_factors, chunk_gated_delta_rule
from .cp import check_cp_call, cp_gated_delta_rule
from .gates import activate_gates, check_gate_args
from .inputs import check_chunk_size, check_rule_inputs, check_sequences, state_dtype
from .naive import naive_recurrence
from .summary import fold_chunk_transitions

__all__ = ["gated_delta_rule", "summarize_segment", "l2_normalize"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32 (or float64); one fused kernel on
    CUDA."""
    if auto_uses_triton(x, "norms"):
        return imported_kernel("norms").triton_l2_normalize(x, eps)
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                     impl: str = "auto", chunk_size: int = 64, cp: CPContext | None = None,
                     decay_params=None, beta_activation: str | None = None):
    """Run the gated delta rule over [B, T] tokens (or one packed row of documents).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head j reads q/k head
    j // (HV // H)); g (log decay, <= 0) and beta: [B, T, HV]; initial_state: [N, HV, K, V] with
    N = B, or the number of documents when `cu_seqlens` [N + 1] describes a packed row (B = 1).
    Returns (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None).

    Context parallelism: with `cp` (the row's plan, `gdn_parallel.comm.CPContext`, which holds the
    global document boundaries and the algorithm, "relay" or "allgather"; give no `cu_seqlens`) the
    tensors are this rank's contiguous 1/cp slice of one packed row; `initial_state` holds the
    documents that start on this rank and the final states returned are those of the documents that
    end on it (docs/design.md §2).

    Activations (the Triton kernels fuse them into their first launch): with `decay_params` =
    (A_log, dt_bias), [HV] each, g holds the logits a of g = -exp(A_log) * softplus(a + dt_bias);
    with `beta_activation` "sigmoid" or "2sigmoid" (allowing negative eigenvalues), beta holds logits.
    """
    check_gate_args(decay_params, beta_activation, v.shape[2] if v.dim() == 4 else 0)
    B, T, H, K, HV, V = _check_inputs(q, k, v, g, beta, initial_state, impl, chunk_size,
                                      g_is_decay=decay_params is None)
    cu_seqlens = _check_sequences(cu_seqlens, initial_state, B, T, cp)
    scale = K ** -0.5 if scale is None else scale
    impl = _resolve_impl(impl, q)
    # The kernels apply the activations and the q/k L2 norm in their first launch; else PyTorch does.
    gates = dict(decay_params=decay_params, beta_activation=beta_activation, use_qk_l2norm=use_qk_l2norm)
    if use_qk_l2norm and impl != "triton":
        q, k = l2_normalize(q), l2_normalize(k)
    if impl == "triton" and cp is None:  # the kernels read grouped q/k heads in place
        return _triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                       gates)
    if impl != "triton":
        g, beta = activate_gates(g, beta, decay_params, beta_activation)
        gates = {}
    if HV != H and impl != "triton":  # the kernels read grouped q/k heads in place (under CP too)
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if cp is not None:
        return _context_parallel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                 impl, chunk_size, cp, gates)

    lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
    if impl == "naive":
        o, final = _naive_per_document(q, k, v, g, beta, scale, initial_state, lengths)
    else:
        q_f, k_f, v_f, g_f, beta_f = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        layout = build_layout(lengths, chunk_size, v.device)
        o, final = chunk_gated_delta_rule(q_f, k_f, v_f, g_f, beta_f, scale=scale, layout=layout,
                                          initial_state=initial_state)
        o = o.reshape(B, T, HV, V)
    return o, (final.to(state_dtype(v)) if output_final_state else None)


def _check_sequences(cu_seqlens, initial_state, batch: int, tokens: int, cp: CPContext | None):
    """cu_seqlens checked (one state per sequence) without CP; under CP, check_cp_call checks the call."""
    return cu_seqlens if cp is not None else check_sequences(cu_seqlens, initial_state, batch, tokens)


def _context_parallel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                      impl, chunk_size, cp: CPContext, gates):
    """q, k normalised and expanded to the value heads by the caller, except with impl "triton" (the
    kernels do both); `gates` the activations left to the kernels (empty when already applied)."""
    check_cp_call(q, cu_seqlens, cp, impl)
    if impl == "triton":
        _check_triton(q, chunk_size)
    return cp_gated_delta_rule(q, k, v, g, beta, scale=scale, cp=cp, chunk_size=chunk_size,
                               initial_state=initial_state, output_final_state=output_final_state, impl=impl,
                               **gates)


def summarize_segment(k, v, g, beta, *, cu_seqlens: torch.Tensor | None = None,
                      use_qk_l2norm: bool = False, chunk_size: int = 64):
    """Affine summary of a segment per sequence and value head: S_out = M @ S_in + S_loc.

    k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]. Returns M [N, HV, K, K] and
    S_loc [N, HV, K, V] (the final state from a zero start), fp32 (float64 for float64 inputs).
    Chunk-parallel: all chunk transitions at once, then a log-depth pairwise fold.
    """
    B, T, H, K, HV, V = _check_inputs(k, k, v, g, beta, None, "chunk", chunk_size)
    cu_seqlens = check_cu_seqlens(cu_seqlens, B, T)
    if use_qk_l2norm:
        k = l2_normalize(k)
    if HV != H:
        k = k.repeat_interleave(HV // H, dim=2)
    dtype = state_dtype(v)
    lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
    layout = build_layout(lengths, chunk_size, v.device)
    q_c, k_c, v_c, g_c, beta_c = (layout.pad(x.reshape(B * T, *x.shape[2:]).to(dtype))
                                  for x in (k, k, v, g, beta))
    factors = chunk_factors(q_c, k_c, v_c, g_c, beta_c, scale=1.0)
    m, s = factors.transition(slice(None))
    return fold_chunk_transitions(m, s, layout)


def _naive_per_document(q, k, v, g, beta, scale, initial_state, lengths):
    if len(lengths) == q.shape[0]:  # plain batch
        return naive_recurrence(q, k, v, g, beta, scale, initial_state)
    outputs, finals, start = [], [], 0
    for i, n in enumerate(lengths):
        piece = [x[:, start:start + n] for x in (q, k, v, g, beta)]
        h0 = None if initial_state is None else initial_state[i:i + 1]
        o, final = naive_recurrence(*piece, scale, h0)
        outputs.append(o)
        finals.append(final)
        start += n
    return torch.cat(outputs, dim=1), torch.cat(finals)


def _resolve_impl(impl: str, x: torch.Tensor) -> str:
    if impl != "auto":
        return impl
    return "triton" if auto_uses_triton(x, "gated_delta_rule") else "chunk"


def _triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, gates):
    kernels = _check_triton(q, chunk_size)
    return kernels.triton_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                           **gates)


def _check_triton(q, chunk_size):
    kernels = check_triton_input(q, "gated_delta_rule", "chunk")
    if chunk_size != kernels.CHUNK:
        raise ValueError(f"impl='triton' runs chunks of {kernels.CHUNK} tokens, got chunk_size={chunk_size}; "
                         f"leave chunk_size at its default or use impl='chunk'")
    return kernels


def _check_inputs(q, k, v, g, beta, initial_state, impl, chunk_size, g_is_decay=True):
    dims = check_rule_inputs(q, k, v, g, beta, initial_state, decay_per_channel=False, g_is_decay=g_is_decay,
                             decay_meaning="g = -exp(A_log) * softplus(.)")
    if impl not in GDN_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {GDN_IMPLS}")
    check_chunk_size(chunk_size)
    return dims
