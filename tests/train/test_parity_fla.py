"""tools/parity_fla.py's loop is the trainer's: on CPU, its `ours` side trained from the exported
initialisation gives the trainer's per-step gradient norms and losses (the same seed, data, micro-batches,
optimizer groups, schedule and clipping), and `compare` applies the issue's bars."""
import json

import pytest

from gdn_parallel.train.__main__ import run as train
from tools.parity_fla import main as parity

SETTINGS = ["model.layer_pattern=G", "model.n_layers=2", "train.seq_len=64", "train.batch_size=4",
            "train.microbatch_size=2", "train.eval_every=0", "train.log_every=1", "checkpoint.interval=0"]
STEPS, WARMUP = 6, 2


def test_the_ours_side_trains_as_the_trainer_does(tmp_path):
    work = tmp_path / "work"
    parity(["prepare", "--config", "configs/tiny-cpu.yaml", "--dir", str(work),
            *(x for s in SETTINGS for x in ("--set", s))])
    parity(["train", "--dir", str(work), "--side", "ours", "--steps", str(STEPS), "--warmup", str(WARMUP),
            "--out", str(tmp_path / "ours.json")])
    ours = json.loads((tmp_path / "ours.json").read_text())
    overrides = [x for s in SETTINGS + [f"train.warmup_steps={WARMUP}", f"train.out_dir={tmp_path / 'run'}"]
                 for x in ("--set", s)]
    train(["--steps", str(STEPS), *overrides])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if isinstance(r.get("step"), int) and "grad_norm" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert ours["grad_norm"] == pytest.approx([r["grad_norm"] for r in steps], rel=1e-5)
    assert ours["loss"] == pytest.approx([r["loss"] for r in steps], rel=1e-5)
    assert ours["param_groups"][0]["weight_decay"] == 0.1 and ours["param_groups"][1]["weight_decay"] == 0.0


def test_compare_applies_the_bars(tmp_path):
    record = {"loss": [3.0] * 60, "grad_norm": [1.0] * 60, "step_s": [0.1] * 60, "param_groups": [],
              "device": "cpu", "fla_guard_lifted": False, "config": "x/config.yaml"}
    (tmp_path / "a.json").write_text(json.dumps(record))
    shifted = dict(record, loss=[3.0] * 55 + [3.2] + [3.0] * 4)  # one step 0.2 apart after step 50
    (tmp_path / "b.json").write_text(json.dumps(shifted))
    args = ["--last", "10", "--settle", "50", "--out", str(tmp_path / "c.json")]
    assert parity(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json"), *args]) == 0
    assert parity(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), *args]) == 1
    assert json.loads((tmp_path / "c.json").read_text())["step_of_max_diff"] == 55
