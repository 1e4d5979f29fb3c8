"""`gdn-verify`: every parallel layout of a job's processes against one device, before trusting a
cluster or a change (docs/parallelism.md, "Checks").

    layouts.py     which layouts (every pp x dp x cp x tp of the world, plus variants), their names
    batches.py     the fixed batch: documents across every CP shard and row boundary
    reference.py   the single-device run every rank computes on its own
    layout_run.py  one layout as the trainer sets it up, gathered and compared on each rank
    checkpoint_leg.py  --checkpoint: each layout's checkpoint saved after an evaluation, resumed into
                   the same layout (bit for bit) and into the reference
    checkpoint_verdict.py  that leg merged over ranks and judged
    compare.py     error metric and pass criteria (fp32; bf16 against one device's bf16)
    runner.py      the reference once, then each layout; results the same on every rank
    report.py      the table and the JSON
    __main__.py    the command line
"""
from .layouts import Layout, default_layouts, parse_layout, parse_layouts

__all__ = ["Layout", "default_layouts", "parse_layout", "parse_layouts"]
