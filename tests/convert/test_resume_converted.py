"""A checkpoint made by from-hf is one our trainer resumes from: step 0, the folder's weights (its first
loss is what those weights give on the first batch of the data stream), a fresh optimizer."""
import torch

from gdn_parallel.config import Config
from gdn_parallel.convert import model_from_hf
from gdn_parallel.convert.__main__ import main
from gdn_parallel.data import TokenBatches
from gdn_parallel.train.__main__ import run

SHORT_RUN = ["--steps", "1", "--set", "train.seq_len=32", "--set", "train.batch_size=1", "--set",
             "train.eval_rows=2", "--set", "train.warmup_steps=0", "--set", "train.log_every=1"]


def test_the_trainer_resumes_from_a_converted_folder(hybrid_checkpoint, tmp_path):
    folder, converted, run_dir = tmp_path / "hf", tmp_path / "step_0", tmp_path / "run"
    assert main(["to-hf", str(hybrid_checkpoint), str(folder)]) == 0
    assert main(["from-hf", str(folder), str(converted)]) == 0
    summary = run(["--config", str(converted / "config.yaml"), *SHORT_RUN, "--set",
                   f"train.out_dir={run_dir}", "--resume", str(converted)])
    assert summary["start_step"] == 0 and summary["steps"] == 1
    assert (run_dir / "checkpoints" / "step_1" / "COMPLETE").is_file()

    config = Config.from_yaml(converted / "config.yaml", ["train.seq_len=32", "train.batch_size=1"])
    batch = next(TokenBatches.from_config(config.data, config.train.seq_len, config.train.microbatch_rows))
    with torch.no_grad():
        loss = model_from_hf(folder)(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens).loss
    assert abs(summary["losses"][0] - loss.item()) <= 1e-6 * loss.item()
