"""The training entry point on the tiny CPU config: it learns, overrides work, errors name fields."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gdn_parallel.config import Config, ModelConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.train.__main__ import build_parser, load_config, main, resolve_config_path
from gdn_parallel.train.optim import param_groups
from gdn_parallel.train.progress import ProgressLogger, ProgressSettings, format_duration

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^step \d+/\d+ \| loss \d+\.\d{4} \| lr \d\.\de[-+]\d\d \| grad_norm \d+\.\d\d \| "
                  r"tok/s [\d,]+ \| mfu (n/a|\d+\.\d+%) \| mem [\d,]+ MiB \| eta \S+$")


def test_main_trains_20_steps_and_loss_falls(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default config is found through the repository root
    assert main(["--steps", "20", "--set", "train.log_every=5", "--set", "train.eval_rows=2",
                 "--set", "train.batch_size=2",
                 "--set", f"train.out_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = records[-1]["summary"]
    assert summary["steps"] == 20
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["final_loss"])
    assert abs(summary["first_loss"] - math.log(256)) < 0.3      # starts at chance
    assert summary["final_loss"] < summary["first_loss"] - 0.8     # and learns within 20 steps
    assert summary["val_loss"] is not None and summary["val_loss"] < summary["first_loss"]
    assert summary["tokens_per_s"] > 0
    lines = [l for l in out.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in lines] == ["0/20", "5/20", "10/20", "15/20", "19/20"]
    assert all(LINE.match(l) for l in lines), lines
    assert [r["step"] for r in records if "loss" in r] == [0, 5, 10, 15, 19]
    assert any("val_loss" in r for r in records)
    saved = Config.from_yaml(tmp_path / "run" / "config.yaml")
    assert saved.train.steps == 20 and saved.model.layer_pattern == "GS"


def test_overrides_and_steps_shortcut():
    args = build_parser().parse_args(["--set", "train.lr=1e-3", "--set", "model.n_layers=2",
                                      "--set", "data.source=/tmp/x", "--steps", "7"])
    config = load_config(args)
    assert config.train.lr == 1e-3 and config.model.n_layers == 2 and config.data.source == "/tmp/x"
    assert config.train.steps == 7 and config.train.warmup_steps <= 7  # warmup shortened to fit
    default = load_config(build_parser().parse_args([]))
    assert default.train.steps == 200 and default.model.vocab_size == 256
    assert resolve_config_path("configs/tiny-cpu.yaml").is_file()


@pytest.mark.parametrize("argv,field", [
    (["--set", "train.bogus=1"], "bogus"),
    (["--set", "train.lr=-1"], "train.lr"),
    (["--set", "model.layer_pattern=GX"], "model.layer_pattern"),
    (["--set", "train.steps=abc"], "train.steps"),
    (["--steps", "1", "--set", "data.source=/nonexistent/dir"], "data.source"),
])
def test_bad_override_names_the_field(argv, field, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert field in capsys.readouterr().err


def test_no_weight_decay_on_vectors_and_marked_params():
    model = HybridLM(ModelConfig(n_layers=2))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert any(n.endswith("A_log") for n in no_decay_names)
    assert any(n.endswith("dt_bias") for n in no_decay_names)
    assert all(p.dim() >= 2 and not getattr(p, "_no_weight_decay", False) for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_progress_line_format():
    printed = []
    logger = ProgressLogger(ProgressSettings(200, 10, 1024, flops_per_token=6e6, peak_flops=1e12),
                            torch.device("cpu"), printed.append)
    for step in range(11):
        logger.step(step, torch.tensor(4.0 - step * 0.1), 3e-3, torch.tensor(1.234))
    # the printed loss is the mean over the steps since the previous line (steps 1..10 here)
    assert len(printed) == 3 and all(LINE.match(l) for l in printed[:2]), printed
    assert printed[2].startswith("startup | ")    # with the second line (tests/train/test_progress.py)
    assert printed[1].startswith("step 10/200 | loss 3.4500 | lr 3.0e-03 | grad_norm 1.23")
    assert re.search(r"mfu \d+\.\d+%", printed[1])
    assert format_duration(62) == "1m02s" and format_duration(3725) == "1h02m05s"


def test_mfu_counts_the_flops_each_step_was_given():
    printed, peak = [], 1e12
    logger = ProgressLogger(ProgressSettings(200, 10, 1024, flops_per_token=6e6, peak_flops=peak),
                            torch.device("cpu"), printed.append)
    for step in range(11):
        record = logger.step(step, torch.tensor(4.0), 3e-3, torch.tensor(1.0), flops=1e9 * (step + 1))
    # steps 1..10 in the second line's interval: (2 + ... + 11) GFLOP, not 6e6 x 1024 a step
    assert record["mfu"] == pytest.approx(sum(range(2, 12)) * 1e9 / record["interval_s"] / peak)


def test_training_counts_attention_within_the_documents_of_its_rows(tmp_path):
    """configs' data packs documents into rows: full attention's work is that of the pieces, so a
    step's MFU is at most the count for rows of one document each, below it where files end inside rows."""
    from gdn_parallel.train import run_training
    from gdn_parallel.train.metrics_sinks import read_metrics
    config = Config.from_yaml(REPO / "configs" / "tiny-cpu.yaml", [
        "train.steps=2", "train.warmup_steps=1", "train.seq_len=512", "model.n_layers=2",
        "model.layer_pattern=GA", "train.log_every=1", "train.eval_rows=1", "train.eval_every=0",
        "train.peak_tflops=0.001",
        f"train.out_dir={tmp_path}"])
    run_training(config, print_fn=lambda line: None)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "mfu" in r]
    with torch.device("meta"):
        one_document = HybridLM(config.model).flops_per_token(512)
    as_one_document = [one_document * r["tokens_per_s"] / 1e9 for r in records]
    assert len(records) == 2
    assert all(0 < r["mfu"] <= bound * (1 + 1e-12) for r, bound in zip(records, as_one_document))
    assert records[0]["mfu"] < 0.99 * as_one_document[0]   # step 0's rows hold several files each


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "gdn_parallel.train", "--steps", "2",
                           "--set", "train.eval_rows=2", "--set", "model.n_layers=2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step 0/2" in proc.stdout and "step 1/2" in proc.stdout and "val_loss" in proc.stdout


def test_run_training_returns_summary():
    from gdn_parallel.train import run_training
    config = Config.from_yaml(REPO / "configs" / "tiny-cpu.yaml", [
        "train.steps=3", "train.warmup_steps=1", "train.seq_len=64", "model.n_layers=2",
        "train.eval_rows=2", "train.eval_every=2"])
    printed = []
    summary = run_training(config, print_fn=printed.append)
    assert {"first_loss", "final_loss", "val_loss", "steps", "tokens_per_s"} <= set(summary)
    assert summary["steps"] == 3 and len(summary["losses"]) == 3
    assert math.isfinite(summary["val_loss"])
    assert sum(l.startswith("eval step") for l in printed) == 2  # after step 1 and at the end


def test_loss_png_when_matplotlib_is_available(tmp_path):
    pytest.importorskip("matplotlib")
    logger = ProgressLogger(ProgressSettings(5, 2, 64, out_dir=str(tmp_path)), torch.device("cpu"),
                            lambda _: None)
    for step in range(5):
        logger.step(step, torch.tensor(5.0 - step), 1e-3, torch.tensor(1.0))
    logger.eval(4, 2.0)
    logger.close()
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_validation_rows_are_on_the_training_device():
    """Regression (found on a GPU): the fixed validation rows stayed on the host while the model was
    on CUDA, so the first evaluation failed in the embedding lookup. The meta device stands in for a
    GPU here: every token tensor of every row must be on the device given; the document boundaries
    stay on the host, where the ops read them (PackedBatch.to)."""
    from gdn_parallel.data import load_dataset
    from gdn_parallel.train.run_setup import validation_steps
    config = load_config(build_parser().parse_args(["--set", "train.eval_rows=8"]))
    steps = validation_steps(load_dataset(config.data), config, 0, torch.device("meta"), lambda line: None)
    rows = [row for step in steps for row in step]
    assert len(steps) == 2 and rows  # 8 rows in batches of train.batch_size=4
    assert all(t.device.type == "meta" for row in rows for t in (row.input_ids, row.labels, row.position_ids))
    assert all(row.cu_seqlens.device.type == "cpu" for row in rows)
