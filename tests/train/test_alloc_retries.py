"""A step line says when the CUDA allocator freed its cache to find memory since the last line (a slow
interval's cause, like a compilation): the count is the difference of torch's num_alloc_retries."""
from types import SimpleNamespace

import torch

from gdn_parallel.train import run_setup
from gdn_parallel.train.compile_watch import CompileWatch
from gdn_parallel.train.progress import ProgressLogger, ProgressSettings, alloc_retries


def test_line_extras_count_the_retries_since_the_last_line(monkeypatch):
    counts = iter([0, 2, 2, 5])
    monkeypatch.setattr(run_setup, "alloc_retries", lambda device: next(counts))
    run = SimpleNamespace(device=torch.device("cuda"), compile_watch=CompileWatch(), beside_save=False,
                          alloc_retries_seen=0)
    try:
        assert [run_setup._line_extras(run).get("alloc_retries") for _ in range(4)] == [None, 2, None, 3]
    finally:
        run.compile_watch.close()


def test_the_line_says_them_and_cpu_counts_none():
    printed, at = [], {"step": 0}
    logger = ProgressLogger(ProgressSettings(6, 1, 64), torch.device("cpu"), printed.append)
    logger.extras = lambda: {"alloc_retries": 3} if at["step"] == 4 else {}
    for step in range(6):
        at["step"] = step
        logger.step(step, torch.tensor(3.0), 1e-3, torch.tensor(1.0))
    assert [r.get("alloc_retries") for r in logger.records] == [None, None, None, None, 3, None]
    notes = [line for line in printed if line.startswith("note")]
    assert len(notes) == 1
    assert notes[0].startswith("note  | step 4: the CUDA allocator freed its cache 3 time(s)")
    assert alloc_retries(torch.device("cpu")) == 0
