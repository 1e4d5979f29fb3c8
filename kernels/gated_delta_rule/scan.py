"""Where the sequential walk over chunks runs: per document, or per span of chunks side by side.

The state update over a chunk is affine, S_end = M S_start + S_loc, and so is a span of chunks. A
long document is cut into spans of about sqrt(chunks) chunks; one kernel summarises every span at
once (its (M, S_loc), computed by walking the span from [I | 0] with values [0 | U]), `fold_spans`
walks the spans of each document to hand every span its start state, and the ordinary walk then
replays all spans at once. Sequential depth: about 3 sqrt(chunks) instead of chunks, for about 3x
the (otherwise idle) work. The backward is the mirror image with (M^T, R), walking spans backwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..host_index import packed_on_device


@dataclass
class ScanPlan:
    doc_first: torch.Tensor                 # [N] int32, first chunk of each document
    doc_count: torch.Tensor                 # [N] int32, its number of chunks
    span_first: torch.Tensor | None = None   # [S] int32 (None: documents are walked whole)
    span_count: torch.Tensor | None = None
    doc_span_first: torch.Tensor | None = None  # [N] int32, first span of each document
    doc_span_count: torch.Tensor | None = None

    @property
    def num_docs(self) -> int:
        return self.doc_first.numel()

    @property
    def spans(self) -> bool:
        return self.span_first is not None

    @property
    def num_spans(self) -> int:
        if self.span_first is None:
            raise ValueError("this scan plan walks documents whole: it has no spans")
        return self.span_first.numel()


def plan_scan(doc_first: list, doc_count: list, device, span_chunks: int) -> ScanPlan:
    """span_chunks: chunks per span; 0 picks ~sqrt(longest document), < 0 walks documents whole."""
    longest = max(doc_count, default=0)
    if span_chunks == 0:
        span_chunks = max(8, math.isqrt(max(longest - 1, 0)) + 1)
    if span_chunks < 0 or longest < 2 * span_chunks:  # too short to gain from spans
        return ScanPlan(*packed_on_device([doc_first, doc_count], torch.int32, device))
    span_first: list[int] = []
    span_count: list[int] = []
    doc_span_first: list[int] = []
    doc_span_count: list[int] = []
    for first, count in zip(doc_first, doc_count):
        doc_span_first.append(len(span_first))
        for offset in range(0, max(count, 1), span_chunks):
            span_first.append(first + offset)
            span_count.append(min(span_chunks, count - offset))
        doc_span_count.append(len(span_first) - doc_span_first[-1])
    # One host-to-device copy for the whole plan, each table 16-byte aligned whatever N and S are.
    return ScanPlan(*packed_on_device([doc_first, doc_count, span_first, span_count, doc_span_first,
                                       doc_span_count], torch.int32, device))


def fold(summary: torch.Tensor, plan: ScanPlan, state0: torch.Tensor | None, V: int, reverse: bool,
         precision: str, interpret: bool):
    """summary [S, HV, K, K + V] = [M | S_loc] per span -> (state entering every span, state leaving
    every document). With reverse, spans are walked last to first (the backward's (M^T, R))."""
    S, HV, K = summary.shape[:3]
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(32, triton.next_power_of_2(V)))
    starts = torch.empty(S, HV, K, V, dtype=torch.float32, device=summary.device)
    final = torch.empty(plan.num_docs, HV, K, V, dtype=torch.float32, device=summary.device)
    fold_spans[(triton.cdiv(V, BV), HV, plan.num_docs)](
        summary, plan.doc_span_first, plan.doc_span_count, state0 if state0 is not None else final, starts,
        final, HV, K, V, BK, BV, state0 is not None, reverse, precision, interpret)
    return starts, final


@triton.jit
def _fold_step(summary, starts, state, span, hv, cols, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    r = tl.arange(0, BK)
    row_ok = (r < K)[:, None]
    col_ok = (cols < V)[None, :]
    tl.store(starts + ((span * HV + hv) * K + r[:, None]) * V + cols[None, :], state, mask=row_ok & col_ok)
    base = summary + (span * HV + hv) * K * (K + V) + r[:, None] * (K + V)
    m = tl.load(base + r[None, :], mask=row_ok & (r < K)[None, :], other=0.)
    s = tl.load(base + K + cols[None, :], mask=row_ok & col_ok, other=0.)
    return tl.dot(m, state, input_precision=PREC) + s


@triton.jit
def _span(first, count, j, REVERSE: tl.constexpr):
    if REVERSE:
        span = first + count - 1 - j
    else:
        span = first + j
    return span


@triton.jit
def fold_spans(summary, doc_span_first, doc_span_count, state0, starts, final, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_STATE0: tl.constexpr,
               REVERSE: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    col_block, hv, doc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = col_block * BV + tl.arange(0, BV)
    r = tl.arange(0, BK)
    offsets = ((doc * HV + hv) * K + r[:, None]) * V + cols[None, :]
    mask = (r < K)[:, None] & (cols < V)[None, :]
    if HAS_STATE0:
        state = tl.load(state0 + offsets, mask=mask, other=0.)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    first = tl.load(doc_span_first + doc)
    count = tl.load(doc_span_count + doc)
    if INTERPRET:  # Triton's interpreter cannot take a loaded bound in range()
        j = 0
        while j < count:
            state = _fold_step(summary, starts, state, _span(first, count, j, REVERSE), hv, cols, HV, K, V,
                               BK, BV, PREC)
            j += 1
    else:
        for j in range(count):
            state = _fold_step(summary, starts, state, _span(first, count, j, REVERSE), hv, cols, HV, K, V,
                               BK, BV, PREC)
    tl.store(final + offsets, state, mask=mask)
