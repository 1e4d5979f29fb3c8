"""Fused row norms, forward and backward: L2 normalisation (GDN q/k) and the (gated) RMSNorm.

Both are one formula over the last dim of rows x:

    y = x * rstd * weight * silu(gate),   rstd = rsqrt(scale * sum(x^2) + eps)

with scale = 1/N for RMSNorm (a mean) and scale = 1 for L2 (a sum), weight and gate optional. So
one kernel pair serves both. Math is fp32 whatever the input dtype; outputs and gradients come
back in their inputs' dtypes.

Layout: a program holds whole rows in registers, a block of BLOCK_ROWS rows by BLOCK_N columns
with BLOCK_N the power of two >= N. No loop over the hidden dim: x stays in registers between
the reduction and the scaling, so it is read from memory once. Narrow rows are batched so a
program still moves 4096 elements (2048 in the backward, which keeps more tensors live), and
warps grow with the block so a thread holds ~8 fp32 of each live tensor. Compiled for sm_90 (bf16)
that spills no registers up to N = 8192 in the forward and N = 2048 in the backward; beyond, the
backward spills a little (N = 8192, or 4096 with a gate, which the model only uses per head).

Backward, with xhat = x * rstd, dy0 = dy * silu(gate) and dxhat = dy0 * weight:
    dx     = rstd * (dxhat - xhat * scale * sum(dxhat * xhat))   (rstd depends on x too)
    dweight = sum over rows of dy0 * xhat
    dgate  = dy * xhat * weight * silu'(gate),   silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g)
rstd is recomputed from x rather than saved: the row is loaded anyway and the sum is cheap.
dweight is reduced deterministically: each backward program covers a fixed run of rows (4 or 16,
by the rows' width: the settings below), keeps its partial sum in fp32 registers and writes it to its
own row of a buffer, and torch sums the buffer. Short runs pay on an H100 (16 rows ran the residual
norm's backward at hidden 2048 1.55x faster than 4, and 64 slower again; tools/bench_block_kernels.py).
No atomics, and the split depends on the shape only, so the same inputs give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 8192  # whole rows live in registers (see above)
# backward (tools/bench_block_kernels.py sweeps them all): rows per program (the fp32 dw partials then
# take 1/rows of an fp32 copy of x), elements per row block, warps, and the software-pipelining depth of
# a program's loop over its row blocks (1: none). Rows of BWD_ELEMENTS or more (one row a block: the
# blocks' residual norms at hidden 1024-2048) take BWD_ROWS_PER_PROGRAM_WIDE rows per program and
# _blocks' warps; narrower rows (several a block: the gated output norm over 256-wide heads) take
# BWD_ROWS_PER_PROGRAM and BWD_NARROW_WARPS. Chosen from a sweep on an H100 at gdn-1.3b's shapes (the
# residual norm's backward 0.314 -> 0.203 ms, the gated norm's 0.466 -> 0.339 ms, against 4 rows and 8
# warps for both; a second sweep on that machine varied up to 2x per setting) and kept for the trainer's
# A/B: gdn-0.4b and h1-0.4b 3.0% more tokens/s (docs/benchmarks.md).
BWD_ROWS_PER_PROGRAM = 4
BWD_ROWS_PER_PROGRAM_WIDE = 16
BWD_ELEMENTS = 2048
BWD_NARROW_WARPS = 4
BWD_WARPS = 0    # > 0: this many warps for every shape (a sweep's override)
BWD_STAGES = 1


@triton.jit
def _norm_fwd(X, R, H, W, G, Y, M, N, scale, eps, HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr,
              HAS_BRANCH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # int64 offsets: rows * N passes 2^31 at long sequences times wide hidden sizes
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    # padding loads as 0: it adds nothing to the sums and padded rows give rstd = rsqrt(eps), finite
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BRANCH:  # the residual sum h = x + branch, stored, and normalised as stored (rounded)
        h = (x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + offs, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) * scale + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * g * tl.sigmoid(g)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, W, G, DY, DH, DX, DB, DW, DG, M, N, scale, eps, HAS_WEIGHT: tl.constexpr,
              HAS_GATE: tl.constexpr, HAS_STREAM_GRAD: tl.constexpr, HAS_BRANCH: tl.constexpr,
              BLOCKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    # this program's BLOCKS consecutive row blocks; past M they are fully masked
    for i in tl.range(BLOCKS, num_stages=STAGES):
        rows = (pid * BLOCKS + i).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) * scale + eps)
        xhat = x * rstd[:, None]
        if HAS_GATE:
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            y0 = xhat  # the output before the gate
            if HAS_WEIGHT:
                y0 = y0 * w[None, :]
            dg = dy * y0 * sig * (1.0 + g * (1.0 - sig))
            tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
            dy = dy * g * sig
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
            dy = dy * w[None, :]
        dx = (dy - xhat * (tl.sum(dy * xhat, axis=1) * scale)[:, None]) * rstd[:, None]
        if HAS_STREAM_GRAD:  # the residual stream's own gradient, added here rather than by autograd
            dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BRANCH:  # h = x + branch: the branch's gradient is h's, in the branch's dtype
            tl.store(DB + offs, dx.to(DB.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(DW + pid * N + cols, dw, mask=cols < N)


def _blocks(n: int, elements: int):
    """BLOCK_ROWS, BLOCK_N and num_warps for rows of n and about `elements` per program."""
    block_n = triton.next_power_of_2(n)
    block_rows = max(1, elements // block_n)
    return block_rows, block_n, min(16, max(4, block_rows * block_n // 256))


def _backward_launch(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(programs, row blocks per program, BLOCK_ROWS, BLOCK_N, num_warps) of a backward over m rows of n
    (the settings above)."""
    block_rows, block_n, warps = _blocks(n, BWD_ELEMENTS)
    if block_rows == 1:
        rows_per_program = BWD_ROWS_PER_PROGRAM_WIDE
    else:
        rows_per_program, warps = BWD_ROWS_PER_PROGRAM, BWD_NARROW_WARPS
    blocks = max(1, rows_per_program // block_rows)
    return triton.cdiv(m, blocks * block_rows), blocks, block_rows, block_n, BWD_WARPS or warps


class _RowNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps: float, mean: bool, out_dtype: torch.dtype | None = None):
        n = x.shape[-1]
        if n > MAX_HIDDEN:
            raise ValueError(f"fused norms hold a row in registers: last dim {n} > {MAX_HIDDEN}")
        if gate is not None and gate.shape != x.shape:
            raise ValueError(f"gate shape {tuple(gate.shape)} must equal x shape {tuple(x.shape)}")
        x2 = x.reshape(-1, n).contiguous()  # the kernels index rows as row * N
        g2 = None if gate is None else gate.reshape(-1, n).contiguous()
        w = None if weight is None else weight.contiguous()
        y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
        m = x2.shape[0]
        block_rows, block_n, warps = _blocks(n, 4096)
        scale = 1.0 / n if mean else 1.0
        if m > 0:
            # an absent weight/gate is never read (constexpr flags); x stands in for its pointer
            _norm_fwd[(triton.cdiv(m, block_rows),)](
                x2, x2, x2, x2 if w is None else w, x2 if g2 is None else g2, y, m, n, scale, eps,
                HAS_WEIGHT=w is not None, HAS_GATE=g2 is not None, HAS_BRANCH=False, BLOCK_ROWS=block_rows,
                BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, w, g2)
        ctx.scale, ctx.eps, ctx.shape = scale, eps, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, g2 = ctx.saved_tensors
        m, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        dg = None if g2 is None else torch.empty_like(g2)
        programs, blocks, block_rows, block_n, warps = _backward_launch(m, n)
        dw_partial = None if w is None else torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        if m > 0:
            _norm_bwd[(programs,)](
                x2, x2 if w is None else w, x2 if g2 is None else g2, dy2, x2, dx, x2,
                x2 if dw_partial is None else dw_partial, x2 if dg is None else dg, m, n,
                ctx.scale, ctx.eps, HAS_WEIGHT=w is not None, HAS_GATE=g2 is not None,
                HAS_STREAM_GRAD=False, HAS_BRANCH=False,
                BLOCKS=blocks, BLOCK_ROWS=block_rows, BLOCK_N=block_n, STAGES=BWD_STAGES, num_warps=warps)
        dw = None if w is None else dw_partial.sum(0).to(w.dtype)
        return (dx.view(ctx.shape), dw, None if dg is None else dg.view(ctx.shape), None, None, None)


def triton_l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (<= 8192), fp32 math, output in x's dtype."""
    return _RowNorm.apply(x, None, None, eps, False)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight [* silu(gate)] over the last dim (<= 8192): normalise,
    then gate. fp32 math; output in out_dtype (default x's), dx in x's dtype, dweight in weight's,
    dgate in gate's."""
    return _RowNorm.apply(x, weight, gate, eps, True, out_dtype)


class _ResidualRMSNorm(torch.autograd.Function):
    """(h, rmsnorm(h) * weight) with h = x + branch, or h = x itself without a branch. The backward
    takes h's own gradient (from the residual stream's later uses) together with the norm output's
    and adds them inside the norm's backward kernel, where autograd would add them in a pass of its
    own; with a branch it also writes the branch's gradient (h's, cast) from the same kernel."""

    @staticmethod
    def forward(ctx, x, branch, weight, eps: float, out_dtype: torch.dtype | None):
        n = x.shape[-1]
        if n > MAX_HIDDEN:
            raise ValueError(f"fused norms hold a row in registers: last dim {n} > {MAX_HIDDEN}")
        if branch is not None and branch.shape != x.shape:
            raise ValueError(f"branch shape {tuple(branch.shape)} must equal x shape {tuple(x.shape)}")
        ctx.set_materialize_grads(False)
        x2 = x.reshape(-1, n).contiguous()
        b2 = None if branch is None else branch.reshape(-1, n).contiguous()
        h = x2 if b2 is None else torch.empty_like(x2)
        w = weight.contiguous()
        y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
        m = x2.shape[0]
        block_rows, block_n, warps = _blocks(n, 4096)
        if m > 0:
            _norm_fwd[(triton.cdiv(m, block_rows),)](
                x2, x2 if b2 is None else b2, h, w, x2, y, m, n, 1.0 / n, eps,
                HAS_WEIGHT=True, HAS_GATE=False, HAS_BRANCH=b2 is not None, BLOCK_ROWS=block_rows,
                BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(h, w)
        ctx.eps, ctx.shape = eps, x.shape
        ctx.branch_dtype = None if branch is None else branch.dtype
        # without a branch h is x: returned as a view, so that its gradient comes back through here
        return (x.view_as(x) if b2 is None else h.view(x.shape)), y.view(x.shape)

    @staticmethod
    def backward(ctx, dh, dy):
        h, w = ctx.saved_tensors
        m, n = h.shape
        with_branch = ctx.branch_dtype is not None
        if dy is None:  # the norm's output went unused: h's gradient passes through
            db = None if dh is None or not with_branch else dh.to(ctx.branch_dtype)
            return dh, db, None, None, None
        dy2 = dy.reshape(-1, n).contiguous()
        dh2 = None if dh is None else dh.reshape(-1, n).contiguous()
        dx = torch.empty_like(h)
        db = torch.empty(h.shape, dtype=ctx.branch_dtype, device=h.device) if with_branch else None
        programs, blocks, block_rows, block_n, warps = _backward_launch(m, n)
        dw_partial = torch.empty(programs, n, dtype=torch.float32, device=h.device)
        if m > 0:
            _norm_bwd[(programs,)](
                h, w, h, dy2, h if dh2 is None else dh2, dx, h if db is None else db, dw_partial, h, m, n,
                1.0 / n, ctx.eps, HAS_WEIGHT=True, HAS_GATE=False, HAS_STREAM_GRAD=dh2 is not None,
                HAS_BRANCH=with_branch, BLOCKS=blocks, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
                STAGES=BWD_STAGES, num_warps=warps)
        dw = dw_partial.sum(0).to(w.dtype)
        return (dx.view(ctx.shape), None if db is None else db.view(ctx.shape), dw, None, None)


def triton_residual_rms_norm(x: torch.Tensor, branch: torch.Tensor | None, weight: torch.Tensor, eps: float,
                             out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rmsnorm(h) * weight) with h = x + branch (in x's dtype), or h = x without a branch, over the
    last dim (<= 8192): the residual stream and its normalised copy in one pass each way. fp32 math;
    the norm's output in out_dtype (default x's), gradients in their inputs' dtypes."""
    return _ResidualRMSNorm.apply(x, branch, weight, eps, out_dtype)
