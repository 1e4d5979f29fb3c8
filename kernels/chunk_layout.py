"""Documents of a packed row laid out chunk-aligned, so every chunk belongs to one document.

Each document is padded at its end to a multiple of the chunk size with tokens that leave the state
unchanged (k = v = q = 0, g = 0, beta = 0): S_t = 1 * (I - 0) S_{t-1} + 0. Padding is internal and
removed from the outputs; nothing reaches the caller.

The PyTorch ops copy their inputs into the padded layout (`pad`, `unpad`). The Triton kernels read
and write the caller's unpadded rows in place through `chunk_rows`: chunk c holds the tokens
chunk_rows[c, 0] .. + chunk_rows[c, 1] - 1 of the caller's tensor, its other rows are padding (read
as zeros, never written). Copying into a padded layout cost a gdn-0.4b step 18 ms on an H100
(index_copy and gather of q, k, v and their gradients in every layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_index import packed_on_device


@dataclass
class ChunkLayout:
    chunk_size: int
    num_docs: int
    padded_len: int
    token_dest: torch.Tensor      # [total] index of each real token in the padded row
    chunk_rows: torch.Tensor      # [num_chunks, 2] int64: first source row of each chunk, its real tokens
    doc_first_chunk: list         # first chunk index of each document
    doc_num_chunks: list          # number of chunks of each document
    doc_lengths: list

    @property
    def num_chunks(self) -> int:
        return self.padded_len // self.chunk_size

    @property
    def num_tokens(self) -> int:
        return self.token_dest.numel()

    @property
    def max_chunks(self) -> int:
        return max(self.doc_num_chunks) if self.doc_num_chunks else 0

    def pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[total, ...] -> [num_chunks, chunk, ...] with `fill` (zeros) in the padding."""
        if self.padded_len == x.shape[0]:
            padded = x
        else:
            padded = x.new_full((self.padded_len, *x.shape[1:]), fill).index_copy(0, self.token_dest, x)
        return padded.reshape(self.num_chunks, self.chunk_size, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[num_chunks, chunk, ...] -> [total, ...]."""
        flat = x.reshape(self.padded_len, *x.shape[2:])
        if self.padded_len == self.token_dest.numel():
            return flat
        return _TakeRows.apply(flat, self.token_dest)


class _TakeRows(torch.autograd.Function):
    """x.index_select(0, rows) for distinct rows. Its backward puts the gradient rows back with a
    plain scatter (index_copy); index_select's own backward accumulates them (index_add, with
    atomics: 5.3 ms of a gdn-0.4b step on an H100) as if rows could repeat."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        ctx.source_shape = x.shape
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.new_zeros(ctx.source_shape).index_copy_(0, rows, grad), None


def build_layout(doc_lengths: list, chunk_size: int, device) -> ChunkLayout:
    first, counts, dest, rows = [], [], [], []
    chunk_cursor = source_row = 0
    for length in doc_lengths:
        n = -(-length // chunk_size)
        first.append(chunk_cursor)
        counts.append(n)
        dest.append(torch.arange(length) + chunk_cursor * chunk_size)
        rows += [(source_row + i * chunk_size, min(chunk_size, length - i * chunk_size)) for i in range(n)]
        chunk_cursor += n
        source_row += length
    token_dest = torch.cat(dest) if dest else torch.zeros(0, dtype=torch.long)
    # one host-to-device copy for both tables (each copy from pageable memory waits for the GPU), each
    # 16-byte aligned
    token_dest, chunk_rows = packed_on_device([token_dest, rows], torch.long, device)
    return ChunkLayout(chunk_size, len(doc_lengths), chunk_cursor * chunk_size, token_dest,
                       chunk_rows.view(chunk_cursor, 2), first, counts, list(doc_lengths))
