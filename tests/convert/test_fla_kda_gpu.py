"""On a GPU: a KDA checkpoint our trainer wrote, exported in bf16, gives in flash-linear-attention's
KDAForCausalLM (its chunked KDA Triton kernels, bf16) the loss our model gives on the same weights.

The model is trained a few steps on the GPU first so the weights are not the init's, at the head sizes of
configs/kimi-1.3b.yaml's KDA layers (K = V = 128) and a small width. Both sides read the exported bf16
weights: fla computes in bf16 as a user of the export would; ours computes in fp32 on those weights
widened exactly, the reference. The mean cross-entropy over 2 x 2048 tokens must agree within 1e-3
(absolute; about 2e-4 of the loss): bf16 rounding of activations averages out over the tokens, a wrong
convention (decay layout, beta, gate, norm) does not. Run: python3 -m pytest -q -m gpu
tests/convert/test_fla_kda_gpu.py
"""
import pytest
import torch

from gdn_parallel.config import IGNORE_INDEX
from gdn_parallel.convert import model_from_hf
from gdn_parallel.convert.__main__ import main as convert
from gdn_parallel.train.__main__ import run as train

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is not installed")

SETTINGS = {"model.vocab_size": 256, "model.hidden_size": 512, "model.n_layers": 4,
            "model.layer_pattern": "K", "model.kda_num_heads": 4, "model.kda_head_dim": 128,
            "model.kda_expand_v": 1.0, "model.tie_word_embeddings": False, "train.seq_len": 1024,
            "train.batch_size": 2, "train.microbatch_size": 2, "train.steps": 3, "train.warmup_steps": 1,
            "train.lr": 1e-3, "train.log_every": 1, "train.eval_every": 0, "train.dtype": "bfloat16"}
LOSS_TOLERANCE = 1e-3


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Our labels for fla's `labels=ids`: fla shifts them, predicting token t + 1 at t (none at the end)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


def test_fla_gives_our_loss_on_a_bf16_kda_export(tmp_path):
    overrides = [x for key, value in SETTINGS.items() for x in ("--set", f"{key}={value}")]
    train(overrides + ["--set", f"train.out_dir={tmp_path / 'run'}"])
    assert convert(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0

    ids = torch.randint(0, 256, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    ours = model_from_hf(tmp_path / "hf", device="cuda").float().eval()  # bf16 weights, exactly, in fp32
    theirs = fla_models.KDAForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        reference = float(ours(ids, labels=next_token_labels(ids)).loss)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours_bf16 = float(ours(ids, labels=next_token_labels(ids)).loss)
        fla_bf16 = float(theirs(ids, labels=ids).loss)
    print(f"mean cross-entropy: ours fp32 {reference:.6f}, ours bf16 {ours_bf16:.6f}, "
          f"fla bf16 {fla_bf16:.6f}")
    assert abs(fla_bf16 - reference) <= LOSS_TOLERANCE, (fla_bf16, reference)
