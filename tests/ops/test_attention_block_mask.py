"""FlexAttention's block mask from per-block bounds (ops/attention/block_mask.py) against the dense
mask rule: a full tile passes every pair, a tile left out passes none, at lengths of several
128-token tiles with documents, windows, short last tiles and a context-parallel key halo."""
import importlib

import pytest
import torch

from gdn_parallel.ops.attention import attention, attention_reference, masked_attention
from gdn_parallel.ops.attention.block_mask import BLOCK, tile_classes
from gdn_parallel.ops.attention.masked import _allowed
from gdn_parallel.ops.rope import document_ids_from_cu_seqlens
from tests.seeds import generator

CASES = {  # name: (queries' global indices, keys' global indices, cu_seqlens of the whole row)
    "one_document": (range(0, 512), range(0, 512), [0, 512]),
    "documents_short_last_tile": (range(0, 450), range(0, 450), [0, 100, 101, 300, 450]),
    # a context-parallel rank: queries 300..599, keys a 200-token halo then the local tokens
    "halo": (range(300, 600), range(100, 600), [0, 50, 420, 600]),
}


def _case(name):
    q_range, k_range, cu = CASES[name]
    doc = document_ids_from_cu_seqlens(torch.tensor(cu), cu[-1])
    q_index, k_index = torch.tensor(list(q_range)), torch.tensor(list(k_range))
    return q_index, k_index, doc[q_index], doc[k_index], cu


@pytest.mark.parametrize("window", [1, 64, 200, None])
@pytest.mark.parametrize("name", list(CASES))
def test_tiles_agree_with_the_dense_rule(name, window):
    q_index, k_index, q_doc, k_doc, _ = _case(name)
    partial, full = tile_classes(q_index, k_index, q_doc, k_doc, window)
    dense = _allowed(q_index[:, None], k_index[None], q_doc[:, None], k_doc[None], window)
    assert not (partial & full).any()
    for i in range(partial.shape[0]):
        for j in range(partial.shape[1]):
            tile = dense[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            if full[i, j]:
                assert tile.shape == (BLOCK, BLOCK) and tile.all(), (i, j)
            elif not partial[i, j]:
                assert not tile.any(), (i, j)
    if name == "one_document" and window is None:  # causal: every tile below the diagonal is full
        below = torch.ones_like(full).tril(-1)
        assert torch.equal(full, below) and torch.equal(partial, torch.eye(len(full), dtype=torch.bool))


# A halo of 200 keys serves windows up to 201 only: the halo case has no full-causal variant.
@pytest.mark.parametrize("name,window", [(name, window) for name in CASES for window in (1, 64, None)
                                         if not (name == "halo" and window is None)])
def test_flex_with_these_tiles_matches_the_oracle(name, window):
    q_index, k_index, q_doc, k_doc, cu = _case(name)
    g = generator(5)
    row = [torch.randn(1, cu[-1], heads, 16, generator=g, dtype=torch.float64) for heads in (4, 2, 2)]
    expected = attention_reference(*row, window=window, cu_seqlens=torch.tensor(cu))[:, q_index]
    q, k, v = row[0][:, q_index], row[1][:, k_index], row[2][:, k_index]
    out = masked_attention(q, k, v, q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc,
                           window=window, impl="flex")
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    if name != "halo":
        whole = attention(*row, window=window, cu_seqlens=torch.tensor(cu), impl="flex")
        torch.testing.assert_close(whole, expected, atol=1e-10, rtol=1e-10)


def test_a_rows_layers_share_one_block_mask_and_its_document_ids(monkeypatch):
    """With a row's memo (SequenceInfo.memo) the document ids and each window's block mask are built
    by the first layer and reused by the others (and by their recomputation), with the same output."""
    masked = importlib.import_module("gdn_parallel.ops.attention.masked")  # ops.attention is also a function
    built = []
    real = masked.block_mask
    monkeypatch.setattr(masked, "block_mask", lambda *args: built.append(args[-1]) or real(*args))
    _, _, _, _, cu = _case("documents_short_last_tile")
    g = generator(6)
    row = [torch.randn(1, cu[-1], heads, 16, generator=g, dtype=torch.float64) for heads in (4, 2, 2)]
    cu_seqlens = torch.tensor(cu)
    memo: dict = {}
    for window in (64, 64, None, 64, None):   # an "SASAA"-like stack
        out = attention(*row, window=window, cu_seqlens=cu_seqlens, impl="flex", memo=memo)
        alone = attention(*row, window=window, cu_seqlens=cu_seqlens, impl="flex")
        assert torch.equal(out, alone), window
    assert built.count(64) == 1 + 3 and built.count(None) == 1 + 2   # memo: once; alone: every call
    assert sum(1 for key in memo if key[0] == "row indices") == 1


def test_a_shards_layers_share_one_block_mask(monkeypatch):
    """Under context parallelism (here two sequence chunks of one process, the halo handed over in
    process) each shard's layers build the block mask of its geometry once, with the same output."""
    from gdn_parallel.comm.context import CPContext, Loopback
    masked = importlib.import_module("gdn_parallel.ops.attention.masked")
    built = []
    real = masked.block_mask
    monkeypatch.setattr(masked, "block_mask", lambda *args: built.append(args[-1]) or real(*args))
    cu = [0, 100, 300, 512]
    g = generator(7)
    row = [torch.randn(1, 512, heads, 16, generator=g, dtype=torch.float64) for heads in (4, 2, 2)]
    expected = attention_reference(*row, window=200, cu_seqlens=torch.tensor(cu))
    for memos in ([{}, {}], [None, None]):
        loopback = Loopback()
        plans = [CPContext(None, r, 2, cu, 256, chunks=2, loopback=loopback) for r in range(2)]
        for _layer in range(3):
            out = torch.cat([attention(*(t[:, 256 * r:256 * (r + 1)] for t in row), window=200, impl="flex",
                                       cp=plans[r], memo=memos[r]) for r in range(2)], dim=1)
            torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    assert len(built) == 2 + 3 * 2   # with memos: once per shard; without: every call
