"""The main job under torchrun: the same losses as the single-process job for model-parallel layouts
(they see the same data), and a clear error when the layout needs more processes."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_parallel.train.__main__ import run

REPO = Path(__file__).resolve().parents[2]
STEPS = ["--steps", "3", "--set", "train.log_every=1", "--set", "train.seq_len=128",
         "--set", "train.batch_size=2", "--set", "train.eval_rows=2"]


def torchrun_losses(overrides, nproc=2):
    """(training losses, validation loss) printed by a torchrun job."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "-m", "gdn_parallel.train", *STEPS, *sum((["--set", o] for o in overrides), [])]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/3 \| loss ([0-9.]+)", out.stdout, re.M)]
    val = re.findall(r"^eval step 2/3 \| val_loss ([0-9.]+)", out.stdout, re.M)
    return losses, float(val[0]) if val else None


@pytest.fixture(scope="module")
def single_process_run():
    summary = run(STEPS)
    return summary["losses"], summary["val_loss"]


@pytest.mark.parametrize("overrides", [["parallel.cp=2"],
                                       ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                       ["parallel.pp=2", "train.microbatch_size=1"]])
def test_torchrun_layout_reproduces_single_process_losses(overrides, single_process_run):
    """Training and validation (evaluated under the layout itself) give the single-process numbers."""
    (losses, val), (single_losses, single_val) = torchrun_losses(overrides), single_process_run
    assert len(losses) == 3
    for a, b in zip(losses, single_losses):
        assert abs(a - b) < 1e-3, (losses, single_losses)
    assert val is not None and abs(val - single_val) < 1e-3, (val, single_val)


def test_layout_without_processes_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        run([*STEPS, "--set", "parallel.cp=2"])
    assert "torchrun --nproc_per_node=2" in capsys.readouterr().err
