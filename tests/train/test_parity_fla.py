"""tools/parity_fla.py's loop is the trainer's: on CPU, its `ours` side trained from the exported
initialisation gives the trainer's per-step gradient norms and losses (the same seed, data, micro-batches,
optimizer groups, schedule and clipping), and `compare` applies the issue's bars."""
import json

import pytest
import torch

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


def test_train_settings_and_the_spike_summary(tmp_path):
    """`train --set` changes a run's setting (another micro-batch split: the same step losses up to
    rounding), and `spikes` reports the rise, the steps and how two runs' loss changes correlate."""
    work = tmp_path / "work"
    parity(["prepare", "--config", "configs/tiny-cpu.yaml", "--dir", str(work),
            *(x for s in SETTINGS for x in ("--set", s))])
    runs = {"micro2": [], "micro1": ["--set", "train.microbatch_size=1"]}
    for name, extra in runs.items():
        parity(["train", "--dir", str(work), "--side", "ours", "--steps", str(STEPS), "--warmup", str(WARMUP),
                "--out", str(tmp_path / f"{name}.json"), *extra])
    micro2, micro1 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in runs)
    assert micro1["overrides"] == ["train.microbatch_size=1"]
    assert micro1["init"]["init"] == "ours" and micro1["init"]["tensors_from_fla"] == 0
    assert "micro-batches of 1" in micro1["batch"] and "micro-batches of 2" in micro2["batch"]
    assert micro1["loss"] == pytest.approx(micro2["loss"], rel=1e-4)

    spiky = dict(micro2, loss=[5.0, 4.0, 4.5, 3.0, 2.0, 3.2, 1.5], grad_norm=[1.0] * 7)
    (tmp_path / "spiky.json").write_text(json.dumps(spiky))
    (tmp_path / "calm.json").write_text(json.dumps(dict(spiky, loss=[x * 2 for x in spiky["loss"]])))
    assert parity(["spikes", str(tmp_path / "spiky.json"), str(tmp_path / "calm.json"), "--rise", "0.4",
                   "--from-step", "1", "--out", str(tmp_path / "s.json")]) == 0
    first, second = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert (first["largest_rise"], first["at_step"]) == (pytest.approx(1.2), 5)
    assert first["steps_rising_more"] == [2, 5]
    assert second["corr_changes_with_first"] == pytest.approx(1.0)  # the same changes, scaled


def test_prepare_takes_named_tensors_from_fla_init(tmp_path):
    pytest.importorskip("fla", reason="fla-core is a reference, not a dependency")
    from gdn_parallel.convert.safetensors_io import read_folder
    settings = [x for s in SETTINGS for x in ("--set", s)]
    ours, mixed = tmp_path / "ours", tmp_path / "mixed"
    parity(["prepare", "--config", "configs/tiny-cpu.yaml", "--dir", str(ours), *settings])
    parity(["prepare", "--config", "configs/tiny-cpu.yaml", "--dir", str(mixed), *settings,
            "--take-from-fla", r"conv1d\.weight$"])
    a, b = read_folder(ours / "hf"), read_folder(mixed / "hf")
    changed = sorted(n for n in a if not torch.equal(a[n], b[n]))
    assert changed and all(n.endswith("conv1d.weight") for n in changed)
    assert all(0.01 < float(b[n].std()) < 0.03 for n in changed)  # fla-core's N(0, 0.02)
    assert json.loads((mixed / "init_source.json").read_text())["tensors_from_fla"] == len(changed)
    with pytest.raises(SystemExit, match="matches no exported tensor"):
        parity(["prepare", "--config", "configs/tiny-cpu.yaml", "--dir", str(tmp_path / "none"), *settings,
                "--take-from-fla", "no_such_name"])
