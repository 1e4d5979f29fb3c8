"""tools/multi_gpu_acceptance.py's arithmetic (the legs themselves need GPUs, or run as --smoke): the
step-time table from metrics records, the verify halves cover the default set once, the markdown
table reads every leg."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import multi_gpu_acceptance as acceptance  # noqa: E402

from tools import process_tree  # noqa: E402


def _records(times, compiled=None, saving=()):
    compiled = compiled or {}
    return [{"step": s, "interval_s": t, "interval_steps": 1, "tokens_per_s": 1000 / t,
             **({"compiled": compiled[s]} if s in compiled else {}),
             **({"saving": True} if s in saving else {})}
            for s, t in enumerate(times)]


def test_step_table_names_the_worst_step_and_the_one_after_the_save():
    records = _records([40.0, 5.0, 2.0, 2.2, 1.8, 3.0, 2.0], compiled={0: {"graphs": 1}, 5: {"graphs": 1}},
                       saving=(5, 6))
    table = acceptance.step_table(records, save_after=4)
    assert table["median_s"] == 2.0                    # of steps 2..6: 2.0, 2.2, 1.8, 3.0, 2.0
    assert (table["worst_step"], table["worst_over_median"]) == (5, 1.5)
    assert (table["after_save_step"], table["after_save_over_median"]) == (5, 1.5)
    assert table["compiled"] == {"0": {"graphs": 1}, "5": {"graphs": 1}} and table["saving"] == [5, 6]
    assert table["tokens_per_s_median"] == 500


def test_a_log_interval_of_several_steps_is_not_a_step_time():
    records = _records([40.0, 5.0, 2.0, 2.0])
    records[3]["interval_steps"] = 2
    assert list(acceptance.step_table(records, save_after=1)["step_s"]) == ["0", "1", "2"]


def test_other_ranks_compilations_are_read_from_the_log(tmp_path, capsys):
    """The lines are the trainer's own: a rank-2 logger's note, among a step line and rank 0's notes."""
    import torch

    from gdn_parallel.train.progress import ProgressLogger, ProgressSettings
    logger = ProgressLogger(ProgressSettings(4, 1, 64), torch.device("cpu"), lambda line: None)
    logger.rank = 2
    logger._say_compiled(3, {"triton": {"_conv_fwd_kernel": 1, "_conv_dz_kernel": 1}})
    note = capsys.readouterr().out.strip()
    assert note == ("note  | rank 2, step 3: 2 Triton kernel compilations (_conv_dz_kernel 1, "
                    "_conv_fwd_kernel 1) since the last line (seconds of this interval)")
    log = tmp_path / "long_4gpu.log"
    rank_zero = ["note  | step 3: 1 Triton kernel compilations (state_forward 1) since the last line",
                 "note  | step 5: the CUDA allocator freed its cache 1 time(s)"]
    log.write_text("\n".join(["step 3/9 | loss 5.1", note, *rank_zero]) + "\n")
    assert acceptance.other_ranks_compiled(log) == [note]
    assert acceptance.other_ranks_compiled(tmp_path / "missing.log") == []


@pytest.mark.parametrize("gpus", [2, 4])
def test_the_verify_halves_cover_the_default_set_once(gpus):
    whole = acceptance.verify_layouts(gpus, "1/1")
    halves = acceptance.verify_layouts(gpus, "1/2") + acceptance.verify_layouts(gpus, "2/2")
    assert halves == whole and len(whole) == len(set(whole)) and whole
    assert acceptance.verify_layouts(gpus, None) == []   # no part: gdn-verify's own default set


def test_the_table_has_a_row_per_leg(tmp_path):
    legs = {
        "verify": {"leg": "verify", "gpus": 2, "device": "H100", "passed": True, "part": None,
                   "layouts": [{"name": "dp2,ddp", "status": "pass"}, {"name": "tp4", "status": "skipped"}]},
        "long": {"leg": "long", "gpus": 2, "device": "H100", "passed": False, "config": "c.yaml", "steps": 8,
                 "save_after_step": 3, "steady_within_bound": False, "resume_bitwise": True,
                 "steps_table": acceptance.step_table(_records([9.0, 3.0, 3.0, 3.0, 6.0, 3.0]), 3)},
        "drill": {"leg": "drill", "gpus": 2, "device": "H100", "passed": True,
                  "tally": {"recovered": 2, "jobs": 2}},
    }
    paths = []
    for name, leg in legs.items():
        paths.append(tmp_path / f"leg_{name}.json")
        paths[-1].write_text(json.dumps(leg))
    rows = acceptance.table(paths).splitlines()[2:]
    assert len(rows) == 3
    assert "1 layouts pass" in rows[0] and "| pass |" in rows[0]
    assert "worst x2.0 (step 4)" in rows[1] and "within 15%: no" in rows[1] and "| FAIL |" in rows[1]
    assert "recovered 2 of 2" in rows[2]


def test_the_document_layout_cuts_each_step_into_the_ranks_shares(tmp_path, monkeypatch):
    """Per step and CP rank: [pieces, longest, first, last] of the rank's 2048-token share."""
    import subprocess
    lengths = [300, 5000, 70, 9000, 1200, 40, 20000, 800]
    source = tmp_path / "docs"
    source.mkdir()
    for i, n in enumerate(lengths):
        (source / f"doc{i}.txt").write_text("ab" * (n // 2))
    subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), str(source),
                    "--tokenizer", "bytes", "--out", str(tmp_path / "prepared")],
                   check=True, capture_output=True)
    config = tmp_path / "long.yaml"
    config.write_text("train:\n  seq_len: 8192\n  batch_size: 1\n")
    monkeypatch.setattr(acceptance, "REPO", tmp_path)
    layout = acceptance.document_layout("long.yaml", tmp_path / "prepared", steps=3, ranks=4)
    assert sorted(layout) == ["0", "1", "2"]
    for per_rank in layout.values():
        assert len(per_rank) == 4
        for pieces, longest, first, last in per_rank:
            assert 1 <= pieces and max(first, last) <= longest <= 2048
            assert pieces > 1 or first == last == longest == 2048
            assert pieces == 1 or first + last <= 2048


# A stand-in for torchrun: its worker in a session of its own (as torchrun starts them), which says
# `done` and then never ends, as the 1M run's ranks did on 4 H200s (2026-11-28).
_AGENT = """
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "RANK": "0"},
                          start_new_session=True)
print("worker", worker.pid, flush=True)
worker.wait()
"""
_STUCK_WORKER = """
import faulthandler, signal, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
print("done  | 1 steps in 1s", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers in Linux /proc")
def test_a_job_stuck_after_done_is_stopped_with_its_workers_and_their_stacks(tmp_path, monkeypatch):
    monkeypatch.setattr(acceptance, "END_GRACE_S", 1.0)
    log = tmp_path / "job.log"
    result = acceptance.run([sys.executable, "-c", _AGENT, _STUCK_WORKER], log, None, limit_s=120)
    text = log.read_text()
    worker = int(text.split("worker ", 1)[1].split()[0])
    assert result["status"] == "hung after done" and result["wall_s"] < 60
    assert "most recent call first" in text          # the worker's stack, printed on SIGUSR1
    assert not process_tree.running(worker)          # killing the agent's group alone left it running
