"""Rotary position embedding in Triton, forward and backward in one kernel ("rotate_half" layout).

Channel pairs of a head are (i, i + D/2), rotated by the angle a = p * f_i of the token's position p
and the pair's frequency f_i:

    y1 = x1 cos a - x2 sin a        y2 = x2 cos a + x1 sin a

The rotation is orthogonal, so the backward is the same kernel with the angle negated. Angles are
p * f_i in fp32 from the frequencies the caller computes (so both paths round them alike), cos and
sin are taken in registers: x is read once and y written once, where the PyTorch formula makes an
fp32 copy, a rotated copy and three broadcast products, each a pass over memory.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .launch_device import on_tensors_device

__all__ = ["triton_rotary"]

BLOCK_ROWS = 16  # (token, head) rows per program
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # libdevice does not run in the interpreter


@triton.jit
def _within_half_turn(angle):
    """The fp32 angle less its nearest whole number of turns (in fp64, then rounded to fp32): the same
    cos and sin, to fp32's rounding. libdevice takes a slow exact reduction past ~1e5 radians, which
    positions past ~100K reach at the highest frequencies: at 1M-token context the kernel took 5x its
    time on the ranks holding the sequence's far end."""
    exact = angle.to(tl.float64)
    # A Python float enters a kernel as fp32: 2*pi is the fp64 sum of two parts fp32 holds exactly
    # (2*pi to 48 bits: 1e-9 radians off after 1e6 radians of turns, far below fp32's rounding)
    two_pi = (tl.full(angle.shape, 6.2831854820251465, tl.float32).to(tl.float64)
              + tl.full(angle.shape, -1.7484555314695172e-07, tl.float32).to(tl.float64))
    turns = tl.floor(exact * 0.15915494309189535 + 0.5)  # any near-whole count does: |result| ~ pi
    return (exact - turns * two_pi).to(tl.float32)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, freq_ptr, y_ptr, rows, heads, T, pos_rows, HALF, SIGN: tl.constexpr,
                   INTERPRET: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (token, head) rows
    col = tl.arange(0, BLOCK_HALF)
    row_ok, col_ok = row < rows, col < HALF
    token = row // heads
    # positions are [pos_rows, T]: one row per sequence, or one shared by the batch
    p = tl.load(pos_ptr + (token // T % pos_rows) * T + token % T, mask=row_ok, other=0)
    angle = p.to(tl.float32)[:, None] * tl.load(freq_ptr + col, mask=col_ok, other=0.0)[None, :]
    angle = _within_half_turn(angle)
    # libdevice's cos and sin are accurate to an ulp; tl.cos may lower to the approximate instruction
    if INTERPRET:
        cos, sin = tl.cos(angle), tl.sin(angle) * SIGN
    else:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle) * SIGN
    m = row_ok[:, None] & col_ok[None, :]
    first = row[:, None] * (2 * HALF) + col[None, :]
    x1 = tl.load(x_ptr + first, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + first, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y_ptr + first + HALF, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=m)


def _rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, sign: int) -> torch.Tensor:
    B, T, H, D = x.shape
    y = torch.empty_like(x)
    rows = B * T * H
    if rows:
        with on_tensors_device(x):
            _rotary_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
                x, positions, freqs, y, rows, H, T, positions.shape[0], D // 2, SIGN=sign,
                INTERPRET=_INTERPRET, BLOCK_ROWS=BLOCK_ROWS, BLOCK_HALF=triton.next_power_of_2(D // 2))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, freqs):
        ctx.save_for_backward(positions, freqs)
        return _rotate(x.contiguous(), positions, freqs, 1)

    @staticmethod
    def backward(ctx, dy):
        positions, freqs = ctx.saved_tensors
        return _rotate(dy.contiguous(), positions, freqs, -1), None, None


def triton_rotary(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by positions [B or 1, T] (integers, x's device) at freqs [D/2] (fp32);
    output in x's dtype, differentiable in x. Arguments are checked by gdn_parallel.ops.rope."""
    return _Rotary.apply(x, positions.contiguous(), freqs.contiguous())
