"""Every checkpoint of every layout resumes (CPU, gloo, fp32): the journeys' matrix.

Save layouts {one process, dp2 FSDP, dp2 DDP, cp2, tp2, pp2, dp2 x cp2 DDP, dp2 x cp2 FSDP (HSDP)}
x {no evaluation before the save (step 1), an evaluation before it (step 2)} x {synchronous,
asynchronous saves}, each checkpoint resumed under the layout that wrote it (the losses of the
uninterrupted run bit for bit, its final checkpoint too) and on one process (its losses to 1e-6; the
synchronous ones: an asynchronous save holds the same tensors, bit for bit, which is checked instead).

Runs are shared: per layout, its processes train two uninterrupted 3-step runs (sync, async; a
checkpoint after every step, an evaluation after step 2 and at the end) and then the four same-layout
resumes, the layouts of one number of processes one after another in one spawn; the one-process
resumes run here afterwards. The global batch is 2 rows of 64
tokens under every layout (train.batch_size is per data-parallel replica), so every layout trains
the same steps and evaluates the same validation rows.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gdn_parallel.config import Config
from gdn_parallel.convert.dcp_io import read_tensors, tensor_entries
from gdn_parallel.train import run_training
from tests.parallel.launcher import run_workers

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
SAVED_STEPS = (1, 2)    # step 1: no evaluation before the save; step 2: after one (eval_every=2)
MODES = {"sync": False, "async": True}
BASE = ["model.n_layers=2", "train.seq_len=64", "train.warmup_steps=1", "train.log_every=1",
        "train.eval_rows=3", f"train.steps={STEPS}", "train.eval_every=2", "checkpoint.interval=1",
        "train.threads=1"]
LAYOUTS = {   # name: (processes, overrides giving a global batch of 2 rows)
    "one": (1, ["train.batch_size=2"]),
    "dp2-fsdp": (2, ["parallel.dp=2", "train.batch_size=1"]),
    "dp2-ddp": (2, ["parallel.dp=2", "parallel.data_parallel=ddp", "train.batch_size=1"]),
    "cp2": (2, ["parallel.cp=2", "train.batch_size=2"]),
    "tp2": (2, ["parallel.tp=2", "train.batch_size=2"]),
    "pp2": (2, ["parallel.pp=2", "train.batch_size=2", "train.microbatch_size=1"]),
    "dp2xcp2-ddp": (4, ["parallel.dp=2", "parallel.cp=2", "parallel.data_parallel=ddp",
                        "train.batch_size=1"]),
    "dp2xcp2-hsdp": (4, ["parallel.dp=2", "parallel.cp=2", "train.batch_size=1"]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small text corpus (80 standard-library modules): quick to read, with a validation split."""
    root = tmp_path_factory.mktemp("corpus")
    sources = sorted(Path(shutil.__file__).parent.glob("*.py"))[:80]
    for path in sources:
        shutil.copy(path, root / path.name)
    return root


def config_for(corpus: Path, overrides, out_dir: Path, async_save: bool = False) -> Config:
    return Config.from_yaml(REPO / "configs" / "tiny-cpu.yaml",
                            [*BASE, *overrides, f"data.source={corpus}", f"train.out_dir={out_dir}",
                             f"checkpoint.async_save={str(async_save).lower()}"])


def _summary(result: dict) -> dict:
    return {"losses": list(result["losses"]), "val_loss": result["val_loss"],
            "start_step": result["start_step"]}


def _copy_checkpoint(source: Path, out_dir: Path) -> None:
    """A new run directory holding only `source` (as if the run had stopped right after it)."""
    if dist.get_rank() == 0:
        (out_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(source, out_dir / "checkpoints" / source.name)
    dist.barrier()


def train_layout(rank, world, corpus: Path, root: Path, overrides) -> dict:
    """The uninterrupted runs and the same-layout resumes of one layout (on each of its ranks)."""
    results = {}
    for mode, async_save in MODES.items():
        out_dir = root / mode
        results[mode] = _summary(run_training(config_for(corpus, overrides, out_dir, async_save),
                                              lambda _: None))
        for step in SAVED_STEPS:
            resumed = root / f"{mode}-resumed-{step}"
            _copy_checkpoint(out_dir / "checkpoints" / f"step_{step}", resumed)
            config = config_for(corpus, overrides, resumed, async_save)
            results[f"{mode}-resumed-{step}"] = _summary(run_training(config, lambda _: None, resume="auto"))
    return results


def saved_tensors(run_dir: Path, step: int) -> dict:
    path = run_dir / "checkpoints" / f"step_{step}"
    entries = tensor_entries(path)
    return read_tensors(path, entries, entries)


def final_tensors(run_dir: Path) -> dict:
    return saved_tensors(run_dir, STEPS)


def close(got: float, expected: float, bound: float = 1e-6) -> bool:
    return abs(got - expected) <= bound * abs(expected)


def train_layouts(rank, world, corpus: Path, jobs) -> list:
    """train_layout for each (root, overrides) of `jobs`, one after another in these processes."""
    return [train_layout(rank, world, corpus, root, overrides) for root, overrides in jobs]


@pytest.fixture(scope="module")
def matrix(corpus, tmp_path_factory) -> dict:
    """{layout: (its run directory, {run: summary})} for every layout. The layouts of one number of
    processes train in one launch of those processes (a launch costs seconds of imports a process)."""
    roots = {name: tmp_path_factory.mktemp(name) for name in LAYOUTS}
    results = {}
    for processes in sorted({processes for processes, _ in LAYOUTS.values()}):
        names = [name for name, (count, _) in LAYOUTS.items() if count == processes]
        jobs = [(roots[name], LAYOUTS[name][1]) for name in names]
        done = run_workers(train_layouts, processes, corpus, jobs, timeout=300 * len(names))[0]
        results.update({name: (roots[name], runs) for name, runs in zip(names, done)})
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoints_resume_under_the_layout_that_wrote_them(matrix, layout):
    """Bit for bit: the resumed steps' losses, the final validation loss and the final checkpoint
    (parameters and every AdamW slot), whether an evaluation came before the save or not, and
    whether it was written in the background or not."""
    root, runs = matrix[layout]
    assert runs["async"]["losses"] == runs["sync"]["losses"]       # saving in the background changes nothing
    assert runs["async"]["val_loss"] == runs["sync"]["val_loss"]
    for step in SAVED_STEPS:   # ... nor what is saved: so resuming it elsewhere is resuming the sync one
        written = {mode: saved_tensors(root / mode, step) for mode in MODES}
        assert written["async"].keys() == written["sync"].keys(), step
        assert all(torch.equal(written["async"][k], written["sync"][k]) for k in written["sync"]), step
    for mode in MODES:
        straight, final = runs[mode], final_tensors(root / mode)
        for step in SAVED_STEPS:
            resumed = runs[f"{mode}-resumed-{step}"]
            assert resumed["start_step"] == step
            assert resumed["losses"] == straight["losses"][step:], (mode, step)
            assert resumed["val_loss"] == straight["val_loss"], (mode, step)
            again = final_tensors(root / f"{mode}-resumed-{step}")
            assert again.keys() == final.keys() and any(key.startswith("optim.") for key in final)
            differing = [key for key in final if not torch.equal(final[key], again[key])]
            assert not differing, (mode, step, differing[:5])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoints_resume_on_one_process(matrix, corpus, layout, tmp_path):
    """Every synchronous checkpoint of the layout continues on one process with the layout's own losses
    to 1e-6 (the asynchronous ones hold the same tensors: the test above), and the layout trained and
    evaluated as one process does."""
    root, runs = matrix[layout]
    one = matrix["one"][1]["sync"]
    straight = runs["sync"]
    assert all(close(got, want) for got, want in zip(straight["losses"], one["losses"])), (straight, one)
    assert close(straight["val_loss"], one["val_loss"]), (straight["val_loss"], one["val_loss"])
    for step in SAVED_STEPS:
        out_dir = tmp_path / f"sync-{step}"
        (out_dir / "checkpoints").mkdir(parents=True)
        name = f"step_{step}"
        shutil.copytree(root / "sync" / "checkpoints" / name, out_dir / "checkpoints" / name)
        config = config_for(corpus, LAYOUTS["one"][1], out_dir)
        resumed = run_training(config, lambda _: None, resume="auto")
        assert resumed["start_step"] == step
        expected = straight["losses"][step:]
        assert len(resumed["losses"]) == len(expected)
        assert all(close(got, want) for got, want in zip(resumed["losses"], expected)), (step, resumed)
