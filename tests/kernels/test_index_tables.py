"""The index tables the kernels take (document chunks, scan spans, chunk rows) start 16-byte aligned
whatever the documents are: Triton compiles a pointer argument's kernel once per alignment, so a table
sliced at an offset that follows the number of documents made the GDN state kernels compile again in
the middle of a run (configs/h1-1.3b-1m.yaml on 4 H200s, step 1: state_forward and state_backward,
+3 s on that step)."""
import importlib

import pytest
import torch

from .helpers import device  # noqa: F401  (skips the module without triton)

host_index = importlib.import_module("gdn_kernels.host_index")
scan = importlib.import_module("gdn_kernels.gated_delta_rule.scan")
chunk_layout = importlib.import_module("gdn_kernels.chunk_layout")


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_packed_tables_are_aligned_views_of_the_values(dtype):
    for lengths in ([1, 1], [3, 5, 0, 2], [4, 7, 1], [0, 9]):
        parts = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
        views = host_index.packed_on_device(parts, dtype, "cpu")
        for part, view in zip(parts, views):
            assert view.dtype == dtype and view.tolist() == part
            assert aligned(view), f"a table of {len(part)} after {lengths} starts unaligned"


@pytest.mark.parametrize("docs", range(1, 10))
@pytest.mark.parametrize("span_chunks", [-1, 2])
def test_every_scan_table_is_aligned_for_any_number_of_documents(docs, span_chunks):
    counts = [5 + 3 * d for d in range(docs)]     # 5+ chunks each: long enough for spans of 2
    firsts = [sum(counts[:d]) for d in range(docs)]
    plan = scan.plan_scan(firsts, counts, "cpu", span_chunks)
    assert plan.doc_first.tolist() == firsts and plan.doc_count.tolist() == counts
    assert plan.spans == (span_chunks > 0)
    for name in ("doc_first", "doc_count", "span_first", "span_count", "doc_span_first", "doc_span_count"):
        table = getattr(plan, name)
        if table is not None:
            assert aligned(table), f"{name} starts unaligned with {docs} documents"
    if plan.spans:
        assert sum(plan.span_count.tolist()) == sum(counts)
        assert plan.doc_span_count.tolist() == [-(-c // span_chunks) for c in counts]


@pytest.mark.parametrize("lengths", [[37], [37, 64, 1, 90], [3, 5, 7]])
def test_chunk_tables_are_aligned(lengths):
    layout = chunk_layout.build_layout(lengths, 16, "cpu")
    assert aligned(layout.token_dest) and aligned(layout.chunk_rows)
    assert layout.token_dest.numel() == sum(lengths)
    assert layout.chunk_rows[:, 1].sum().item() == sum(lengths)


def test_derived_values_are_made_once_per_tensor_and_version_and_serve_training():
    """host_index.derived: one make() per tensor, key and version; made outside inference mode, so that
    a value first made by an evaluation under torch.inference_mode can be saved for a backward."""
    made = []
    cu = torch.tensor([0, 3, 8])

    def make():
        made.append(1)
        return cu.float() * 2

    with torch.inference_mode():
        first = host_index.derived(cu, "doubled", make)
    assert not first.is_inference()
    assert host_index.derived(cu, "doubled", make) is first and len(made) == 1
    weight = torch.ones(3, requires_grad=True)
    (weight * first).sum().backward()               # saved for backward: fails on an inference tensor
    assert weight.grad.tolist() == [0.0, 6.0, 16.0]
    cu.mul_(1)
    assert host_index.derived(cu, "doubled", make) is not first and len(made) == 2
