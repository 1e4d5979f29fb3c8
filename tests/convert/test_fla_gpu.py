"""On a GPU: a checkpoint our trainer wrote, exported in bf16, computes in flash-linear-attention's
GatedDeltaNetForCausalLM the logits our model computes, within bf16 rounding.

Shapes are those of the paper configs' GDN layers (K = 128, V = 256, grouped heads none) at a small
width; the model is trained a few steps on the GPU first so the weights are not the init's. The
reference is our model in fp32 (weights and compute); both bf16 runs (ours under autocast over the
fp32 weights, fla on the exported bf16 weights) are measured against it and fla's error may be at
most twice ours (plus a floor of 1% of the logits' scale, for a run where ours is unusually close).
"""
import pytest
import torch

from gdn_parallel.convert import model_from_hf
from gdn_parallel.convert.__main__ import main as convert
from gdn_parallel.train.__main__ import run as train

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is not installed")

SETTINGS = {"model.vocab_size": 256, "model.hidden_size": 512, "model.n_layers": 4,
            "model.layer_pattern": "G", "model.gdn_num_heads": 2, "model.gdn_head_dim": 128,
            "model.gdn_expand_v": 2.0, "model.tie_word_embeddings": False, "train.seq_len": 1024,
            "train.batch_size": 2, "train.microbatch_size": 2, "train.steps": 3, "train.warmup_steps": 1,
            "train.lr": 1e-3, "train.log_every": 1, "train.eval_every": 0, "train.dtype": "bfloat16"}


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.float() - reference).norm() / reference.norm())


def test_fla_computes_our_logits_from_a_bf16_export(tmp_path):
    overrides = [x for key, value in SETTINGS.items() for x in ("--set", f"{key}={value}")]
    train(overrides + ["--set", f"train.out_dir={tmp_path / 'run'}"])
    assert convert(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0

    ids = torch.randint(0, 256, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    ours = model_from_hf(tmp_path / "hf", device="cuda").float().eval()  # bf16 weights, exactly, in fp32
    theirs = fla_models.GatedDeltaNetForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
    theirs = theirs.cuda().eval()
    with torch.no_grad():
        reference = ours(ids).logits.float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours_bf16 = ours(ids).logits
        fla_bf16 = theirs(ids).logits
    assert torch.isfinite(reference).all() and torch.isfinite(fla_bf16).all()
    ours_error, fla_error = relative_error(ours_bf16, reference), relative_error(fla_bf16, reference)
    agree = float((fla_bf16.argmax(-1) == reference.argmax(-1)).float().mean())
    print(f"relative error vs fp32: ours bf16 {ours_error:.2e}, fla bf16 {fla_error:.2e}; "
          f"argmax agreement fla/fp32 {agree:.4f}")
    assert fla_error <= max(2 * ours_error, 1e-2), (fla_error, ours_error)
