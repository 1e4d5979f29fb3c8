"""What tests/parallel/test_layouts.py took from the old tools/verify_layouts.py, now built on
gdn_parallel.verify: the layouts by their old names, a packed row with random document cuts, the
norm-relative error, and one device's loss over data-parallel rows."""

from gdn_parallel.config import IGNORE_INDEX
from gdn_parallel.data.packing import random_packed_row
from gdn_parallel.verify.batches import LAYOUT_KINDS, document_boundaries
from gdn_parallel.verify.compare import relative_error
from gdn_parallel.verify.layouts import parse_layout
from gdn_parallel.verify.reference import autocast

OLD_NAMES = ("tp2", "tp2_sp", "pp2_1f1b", "pp2_interleaved", "dp2_fsdp", "dp2_ddp", "cp2", "cp2_allgather",
             "tp2_cp2", "pp2_cp2", "pp2_tp2", "dp2_cp2", "dp2_tp2", "pp2_tp2_cp2")
# name -> ParallelConfig keyword arguments
LAYOUTS = {name: parse_layout(name).parallel_kwargs() for name in OLD_NAMES}
RANDOM_CUTS = LAYOUT_KINDS - 1      # batches.document_boundaries' kind with seeded random cuts


def norm_err(actual, expected) -> float:
    return relative_error(actual, expected)


def packed_row(total: int, vocab: int, seed: int, device):
    """One packed row of `total` tokens with up to three seeded random document cuts."""
    return random_packed_row(document_boundaries(total, RANDOM_CUTS, seed), vocab, seed).to(device)


def single_device_loss(model, rows, dtype):
    """Mean loss of rows[replica][micro-batch] on one device (autocast to `dtype` unless None),
    backward run; returns the detached loss."""
    device = next(model.parameters()).device
    with autocast(dtype, device):
        loss_sum = sum(model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens).loss_sum
                       for replica in rows for b in replica)
    count = sum(int((b.labels != IGNORE_INDEX).sum()) for replica in rows for b in replica)
    loss = loss_sum / count
    loss.backward()
    return loss.detach()
