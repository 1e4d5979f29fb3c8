"""`gdn-convert reshard` under 2 and 4 gloo processes: every parameter and AdamW slot of a trained or a
converted (from-hf) checkpoint lands on its rank as the layout cuts it (pipeline stages; tensor-parallel
pieces with FSDP shards of them), a re-save from that layout holds the same tensors and exports to the
same Hugging Face folder, and a tensor that did not land is reported (exit 1)."""
import json

import torch

from gdn_parallel.checkpoint import read_trainer_state
from gdn_parallel.config import Config
from gdn_parallel.convert import reshard as reshard_module
from gdn_parallel.convert.__main__ import main
from gdn_parallel.convert.safetensors_io import read_folder
from tests.parallel.launcher import run_workers

from .conftest import all_tensors, assert_same_tensors


def reshard_worker(rank, world_size, argv):
    return main(argv)


def report_of(path) -> dict:
    report = json.loads(path.read_text())
    assert report["layout"]["world_size"] == len(report["ranks"])
    return report


def exports_alike(checkpoint, original, tmp_path) -> None:
    """A checkpoint saved under a parallel layout exports to the same folder as the original."""
    assert main(["to-hf", str(checkpoint), str(tmp_path / "saved-hf")]) == 0
    assert main(["to-hf", str(original), str(tmp_path / "original-hf")]) == 0
    assert_same_tensors(read_folder(tmp_path / "saved-hf"), read_folder(tmp_path / "original-hf"))


def test_a_converted_checkpoint_in_pipeline_stages_on_two_processes(hybrid_checkpoint, tmp_path, capsys):
    converted, report, out = tmp_path / "converted", tmp_path / "report.json", tmp_path / "resharded"
    assert main(["to-hf", str(hybrid_checkpoint), str(tmp_path / "hf")]) == 0
    assert main(["from-hf", str(tmp_path / "hf"), str(converted)]) == 0
    argv = ["reshard", str(converted), "--layout", "pp=2", "--out", str(out), "--report", str(report)]
    # the config.yaml --out writes must train as written: a pipeline of 2 stages needs 2 micro-batches
    assert main(argv) == 2 and not out.exists()
    assert ("does not train under this layout: train.microbatch_size=0 gives 1 micro-batch(es)"
            in capsys.readouterr().err)
    assert run_workers(reshard_worker, 2, argv + ["--set", "train.microbatch_size=1"]) == [0, 0]
    result = report_of(report)
    assert result["ok"] and not result["held_by_no_rank"] and result["step"] == 0
    # tied embeddings: the first stage's embedding and the last stage's head are one tensor, on both ranks
    assert result["tensors_checked"] == 4 * (result["model_tensors"] + 1)
    exports_alike(out / "checkpoints" / "step_0", hybrid_checkpoint, tmp_path)


def test_tensor_and_data_parallel_on_four_processes_and_a_resave(hybrid_checkpoint, tmp_path, capsys):
    report, out = tmp_path / "report.json", tmp_path / "resharded"
    argv = ["reshard", str(hybrid_checkpoint), "--layout", "tp=2,dp=2", "--out", str(out), "--report",
            str(report)]
    # train.batch_size is per replica: the run's global batch of one row cannot stay one row over 2 replicas
    assert main(argv) == 2 and not out.exists()
    assert ("global batch of 1 rows (train.batch_size=1 x dp=1) does not split over parallel.dp=2"
            in capsys.readouterr().err)
    argv += ["--set", "train.batch_size=1"]    # a global batch of 2 from here on, chosen explicitly
    assert run_workers(reshard_worker, 4, argv) == [0, 0, 0, 0]
    result = report_of(report)
    assert result["ok"] and result["tensors_checked"] == 4 * 4 * result["model_tensors"]
    saved = out / "checkpoints" / "step_1"
    assert result["saved_to"] == str(saved)
    assert_same_tensors(all_tensors(saved), all_tensors(hybrid_checkpoint))
    state = read_trainer_state(saved)
    assert state["layout"]["tp"] == 2 and state["layout"]["dp"] == 2
    assert state["data"] == read_trainer_state(hybrid_checkpoint)["data"]
    assert (saved / "tokenizer_info.json").read_bytes() == \
        (hybrid_checkpoint / "tokenizer_info.json").read_bytes()
    # as complete as the trainer's: the run's config.yaml names the new run and layout, the checkpoint's too
    assert (state["config"]["train"]["out_dir"] == str(out)
            and state["resharded_from"] == str(hybrid_checkpoint))
    for config_file in (out / "config.yaml", saved / "config.yaml"):
        config = Config.from_yaml(config_file)
        assert config.train.out_dir == str(out) and (config.parallel.tp, config.parallel.dp) == (2, 2)
    exports_alike(saved, hybrid_checkpoint, tmp_path)


def test_a_tensor_that_did_not_land_is_reported(hybrid_checkpoint, tmp_path, monkeypatch, capsys):
    load = reshard_module.load_checkpoint

    def load_then_lose_one(path, named_params, *args, **kwargs):
        saved = load(path, named_params, *args, **kwargs)
        with torch.no_grad():
            dict(named_params)["layers.1.attn.k_proj.weight"][0, 0] += 1.0
        return saved

    monkeypatch.setattr(reshard_module, "load_checkpoint", load_then_lose_one)
    report = tmp_path / "report.json"
    assert main(["reshard", str(hybrid_checkpoint), "--layout", "tp=1", "--report", str(report)]) == 1
    result = report_of(report)
    assert not result["ok"]
    assert result["ranks"][0]["mismatches"] == ["model.layers.1.attn.k_proj.weight: 1 of 512 values "
                                                "differ from the checkpoint"]
    assert "MISMATCH" in capsys.readouterr().out


def test_a_layout_needs_its_processes_and_a_free_output(hybrid_checkpoint, tmp_path, capsys):
    assert main(["reshard", str(hybrid_checkpoint), "--layout", "tp=2,pp=2"]) == 2
    assert "needs 4 processes" in capsys.readouterr().err
    taken = tmp_path / "taken" / "checkpoints" / "step_1"
    taken.mkdir(parents=True)
    report = tmp_path / "report.json"
    assert main(["reshard", str(hybrid_checkpoint), "--layout", "tp=1", "--out", str(tmp_path / "taken"),
                 "--report", str(report)]) == 2
    assert "already holds" in capsys.readouterr().err
    assert not list(taken.iterdir()) and not report.exists()


def test_a_sequence_parallel_run_reshards_to_a_layout_without_tp():
    """The saved run's parallel.sequence_parallel=true stays for a layout with tp and is dropped for
    one without (where it means nothing, and a config asking for it is refused)."""
    saved = Config.from_yaml("configs/tiny-cpu.yaml",
                             ["parallel.tp=2", "parallel.sequence_parallel=true"]).to_dict()
    assert reshard_module.layout_config(saved, "tp=2").parallel.sequence_parallel
    assert not reshard_module.layout_config(saved, "dp=2").parallel.sequence_parallel
