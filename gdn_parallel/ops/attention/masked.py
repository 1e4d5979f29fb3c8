"""Causal softmax attention on one device: sliding window, grouped-query heads, packed documents.

One mask rule covers every case. Query i may attend to key j iff

    q_doc[i] == k_doc[j]  and  0 <= q_index[i] - k_index[j]
                          and  (window is None or q_index[i] - k_index[j] < window)

with global token indices, so a query sees `window` keys including itself (flash-attn convention).
`masked_attention` takes the indices explicitly because under context parallelism the queries are
the local shard while the keys are the halo from previous ranks followed by the local tokens;
`attention` is the single-device form (queries = keys = the whole row).

Two implementations with the same numbers: "sdpa" (dense boolean mask; runs anywhere, autograd
everywhere) and "flex" (FlexAttention with a block mask built from per-block bounds, block_mask.py; compiled
on CUDA so masked-out blocks are skipped; on CPU it runs the unfused eager path and has no backward).
"auto" picks flex on CUDA.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ...config import ATTENTION_IMPLS
from ..rope import document_ids_from_cu_seqlens
from ..validation import check_cu_seqlens, values_checked
from .block_mask import block_mask

__all__ = ["masked_attention", "row_attention", "attention_reference"]

# Query rows per step when checking a dense mask, to bound memory (rows x keys booleans).
_CHECK_ROWS = 4096


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, T, heads, dim], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    B, _, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [{B}, Tk, HKV, {D}] for q {tuple(q.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v has shape {tuple(v.shape)}, expected [{B}, {k.shape[1]}, {k.shape[2]}, Dv] "
                         f"for k {tuple(k.shape)}")
    HKV = k.shape[2]
    if HKV < 1 or H % HKV != 0:
        raise ValueError(f"q has {H} heads, not a multiple of the {HKV} heads of k/v "
                         f"(GQA needs H % HKV == 0)")


def _check_window(window):
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1 (keys seen per query, itself included), "
                         f"got {window!r}")


def _check_index(name: str, t, length: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be a 1-D integer tensor of length {length}, got "
                         f"{getattr(t, 'shape', type(t).__name__)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    return t.to(device=device, dtype=torch.int64)


def _allowed(qi, ki, qd, kd, window):
    """The mask rule on broadcastable index/doc tensors (shared by the dense mask and flex's mask_mod)."""
    dist = qi - ki
    ok = (qd == kd) & (dist >= 0)
    if window is not None:
        ok = ok & (dist < window)
    return ok


def _queries_without_keys(q_index, k_index, q_doc, k_doc, window) -> torch.Tensor:
    """Boolean [Tq]: queries that no key is allowed for (their softmax would be 0/0)."""
    Tk = k_index.shape[0]
    keys_sorted = Tk <= 1 or bool(((k_index[1:] > k_index[:-1]) & (k_doc[1:] >= k_doc[:-1])).all())
    if keys_sorted and Tk > 0:
        # Keys ordered by index with documents contiguous: the best candidate of a query is the
        # last key of its document at or before it (nearest, so inside the window if any is).
        last_le = torch.searchsorted(k_index, q_index, right=True) - 1
        doc_lo = torch.searchsorted(k_doc, q_doc, right=False)
        doc_hi = torch.searchsorted(k_doc, q_doc, right=True)
        j = torch.minimum(last_le, doc_hi - 1)
        found = j >= doc_lo
        jc = j.clamp(0, Tk - 1)
        return ~(found & _allowed(q_index, k_index[jc], q_doc, k_doc[jc], window))
    # Unordered keys: check the dense mask in slices of query rows.
    parts = [~_allowed(q_index[s:s + _CHECK_ROWS, None], k_index[None], q_doc[s:s + _CHECK_ROWS, None],
                       k_doc[None], window).any(-1)
             if Tk else torch.ones_like(q_index[s:s + _CHECK_ROWS], dtype=torch.bool)
             for s in range(0, q_index.shape[0], _CHECK_ROWS)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=q_index.device)


def _sdpa(q, k, v, q_index, k_index, q_doc, k_doc, window, scale):
    H, HKV = q.shape[2], k.shape[2]
    mask = _allowed(q_index[:, None], k_index[None], q_doc[:, None], k_doc[None], window)  # [Tq, Tk]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, dim]
    if HKV != H:  # query head h reads kv head h // (H // HKV): repeat each kv head consecutively
        kt = kt.repeat_interleave(H // HKV, dim=1)
        vt = vt.repeat_interleave(H // HKV, dim=1)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


_compiled: dict = {}


def _flex_attention(device: torch.device):
    """flex_attention, compiled once per process on CUDA (the fused kernel that skips empty tiles),
    eager elsewhere. The block mask needs no compilation (block_mask.py)."""
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention
    if not _compiled:
        _compiled["attn"] = torch.compile(flex_attention)
    return _compiled["attn"]


def _flex(q, k, v, q_index, k_index, q_doc, k_doc, window, scale, memo=None):
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("impl='flex' has no backward on CPU (a FlexAttention limitation); "
                         "use impl='sdpa' or 'auto' when gradients are needed")
    flex_attention = _flex_attention(q.device)

    def mask_mod(b, h, qi, ki):
        return _allowed(q_index[qi], k_index[ki], q_doc[qi], k_doc[ki], window)

    key = ("block mask", window, q_index.shape[0], k_index.shape[0], q.device)
    tiles = None if memo is None else memo.get(key)
    if tiles is None:
        tiles = block_mask(mask_mod, q_index, k_index, q_doc, k_doc, window)
        if memo is not None:
            memo[key] = tiles
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with warnings.catch_warnings():
        # Eager (CPU) flex warns that it is unfused; that is expected off CUDA.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        o = flex_attention(qt, kt, vt, block_mask=tiles, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return o.transpose(1, 2)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_index: torch.Tensor,
                     k_index: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor,
                     window: int | None, scale: float | None = None, impl: str = "auto",
                     memo: dict | None = None) -> torch.Tensor:
    """Attention of q [B, Tq, H, D] over k [B, Tk, HKV, D], v [B, Tk, HKV, Dv] -> [B, Tq, H, Dv].

    q_index/k_index are global token indices, q_doc/k_doc document ids (1-D, shared by the batch);
    the module docstring gives the mask rule. `scale` defaults to D^-0.5. Every query must be
    allowed at least one key (ValueError otherwise). `memo`: a dict for calls that share these
    indices (one row's layers): FlexAttention's block mask is built once and kept in it.
    """
    _check_qkv(q, k, v)
    _check_window(window)
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be None or a float, got {scale!r}")
    Tq, Tk = q.shape[1], k.shape[1]
    q_index = _check_index("q_index", q_index, Tq, q.device)
    k_index = _check_index("k_index", k_index, Tk, q.device)
    q_doc = _check_index("q_doc", q_doc, Tq, q.device)
    k_doc = _check_index("k_doc", k_doc, Tk, q.device)
    blind = (_queries_without_keys(q_index, k_index, q_doc, k_doc, window) if values_checked(q)
             else None)
    if blind is not None and bool(blind.any()):
        first = int(blind.nonzero()[0, 0])
        raise ValueError(f"query {first} (q_index {int(q_index[first])}, q_doc {int(q_doc[first])}) sees "
                         f"no key under window={window}: k_index/k_doc must include its own token or "
                         f"earlier tokens of its document")
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if impl == "auto":
        impl = "flex" if q.device.type == "cuda" else "sdpa"
    if impl == "flex":
        return _flex(q, k, v, q_index, k_index, q_doc, k_doc, window, scale, memo)
    return _sdpa(q, k, v, q_index, k_index, q_doc, k_doc, window, scale)


def _row_indices(q, k, v, causal, window, cu_seqlens, memo: dict | None = None):
    """Indices and document ids of a whole row (queries = keys), after the argument checks; kept in
    `memo` (one row's) for the next call."""
    _check_qkv(q, k, v)
    if not causal:
        raise ValueError("causal=False is not supported: attention here is causal (language modelling)")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k has {k.shape[1]} tokens but q has {q.shape[1]}; use masked_attention for "
                         f"queries and keys of different lengths")
    _check_window(window)
    B, T = q.shape[:2]
    cu = check_cu_seqlens(cu_seqlens, B, T)
    key = ("row indices", T, q.device)
    if memo is not None and key in memo:
        return memo[key]
    index = torch.arange(T, device=q.device)
    doc = torch.zeros(T, dtype=torch.int64, device=q.device) if cu is None \
        else document_ids_from_cu_seqlens(cu, T, device=q.device)
    if memo is not None:
        memo[key] = index, doc
    return index, doc


def row_attention(q, k, v, *, causal: bool, window: int | None, cu_seqlens: torch.Tensor | None,
                  scale: float | None, impl: str, memo: dict | None = None) -> torch.Tensor:
    """Single-device attention over a whole row (queries = keys); see `attention`."""
    index, doc = _row_indices(q, k, v, causal, window, cu_seqlens, memo)
    return masked_attention(q, k, v, q_index=index, k_index=index, q_doc=doc, k_doc=doc,
                            window=window, scale=scale, impl=impl, memo=memo)


def check_cp_call(q, k, v, causal: bool, window: int | None) -> None:
    """The argument checks of `attention` that hold under context parallelism too."""
    _check_qkv(q, k, v)
    _check_window(window)
    if not causal:
        raise ValueError("causal=False is not supported; attention here is causal")


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        window: int | None = None, cu_seqlens: torch.Tensor | None = None,
                        scale: float | None = None, impl: str = "auto") -> torch.Tensor:
    """Dense float64 oracle of `attention` for tests (mask built by a loop; `impl` is ignored)."""
    _row_indices(q, k, v, causal, window, cu_seqlens)
    B, T, H, D = q.shape
    group = H // k.shape[2]
    starts = [0] if cu_seqlens is None else [int(s) for s in cu_seqlens[:-1]]
    ends = [T] if cu_seqlens is None else [int(s) for s in cu_seqlens[1:]]
    mask = torch.zeros(T, T, dtype=torch.bool)
    for start, end in zip(starts, ends):
        for i in range(start, end):
            lo = start if window is None else max(start, i - window + 1)
            mask[i, lo:i + 1] = True
    mask = mask.to(q.device)
    scale = scale if scale is not None else D ** -0.5
    q64, k64, v64 = q.double(), k.double(), v.double()
    kh = torch.stack([k64[:, :, h // group] for h in range(H)], dim=2)  # [B, T, H, D]
    vh = torch.stack([v64[:, :, h // group] for h in range(H)], dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q64, kh) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), vh)
    return o.to(q.dtype)
