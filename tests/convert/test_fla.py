"""Our folders in flash-linear-attention's GatedDeltaNetForCausalLM, and fla's folders in ours.

Exports load into fla's model (strict=True for pure GDN; with our names and nothing missing or left
over for hybrids) and fla computes our logits on the CPU: in eval mode without gradients and at most
64 tokens fla takes its fused-recurrent GDN kernels and its rotary kernel, which Triton's interpreter
runs (tests/conftest.py turns it on without a GPU). fla's attention layers call flash-attn's
`flash_attn_func`, a CUDA-only package: the hybrid test stands in a float64 softmax attention written
from flash-attn's documented semantics (causal; window_size=(left, 0) lets query i see keys
i - left .. i; grouped KV heads; scale 1/sqrt(head_dim)), so fla's own projections, RoPE, head
grouping and window setting (window_size - 1, 0) run around it."""
from importlib.util import find_spec

import pytest
import torch

from gdn_parallel.convert import model_from_hf
from gdn_parallel.convert.__main__ import main
from gdn_parallel.convert.safetensors_io import read_folder

from .conftest import (
    assert_fla_folder_converts_bit_exactly,
    assert_same_tensors,
    greedy_continuation,
    skip_unless_fla_generate_works,
)

for _package, _name in (("transformers", "transformers"), ("fla", "flash-linear-attention")):
    if find_spec(_package) is None:
        pytest.skip(f"{_name} is not installed (pip install -e '.[dev]')", allow_module_level=True)


def fla_models():
    """fla.models, imported by the tests that use it: importing fla (and transformers) takes seconds,
    which collection would pay for every run, even one that selects none of these tests."""
    import fla.models
    return fla.models


@pytest.fixture
def untimed_autotuning(monkeypatch):
    """Triton's autotuner times its configs on a device; the interpreter has none, so every config
    ties and the first is taken (the values do not depend on the config)."""
    from triton.runtime.autotuner import Autotuner
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0])


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, **unused):
    """flash-attn's attention ([B, T, H, D] q; [B, T, H_kv, D] k and v) in float64, from its docs."""
    assert causal and window_size[1] in (-1, 0) and not unused.get("dropout_p")
    heads, length, head_dim = q.shape[2], q.shape[1], q.shape[3]
    k, v = (x.repeat_interleave(heads // x.shape[2], dim=2).double() for x in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k) * (softmax_scale or head_dim ** -0.5)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    visible = (j <= i) & ((j >= i - window_size[0]) if window_size[0] >= 0 else True)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", weights, v).to(q.dtype)


@pytest.fixture
def flash_attn_reference(monkeypatch):
    import fla.layers.attn as fla_attn
    monkeypatch.setattr(fla_attn, "flash_attn_func", flash_attn_func)


def fla_logits(folder, ids) -> torch.Tensor:
    # fuse_* pick fla's fused Triton norms and SwiGLU, not weights: the plain PyTorch ones run faster here
    fla_model = fla_models().GatedDeltaNetForCausalLM.from_pretrained(folder, fuse_norm=False,
                                                                      fuse_swiglu=False).eval()
    with torch.no_grad():
        return fla_model(ids).logits


def our_logits(folder, ids) -> torch.Tensor:
    with torch.no_grad():
        return model_from_hf(folder).eval()(ids).logits


def test_a_pure_gdn_export_loads_into_fla_strictly_and_gives_our_logits(gdn_checkpoint, tmp_path,
                                                                       untimed_autotuning):
    folder = tmp_path / "hf"
    assert main(["to-hf", str(gdn_checkpoint), str(folder)]) == 0
    weights = read_folder(folder)
    models = fla_models()
    fla_model = models.GatedDeltaNetForCausalLM(models.GatedDeltaNetConfig.from_pretrained(folder))
    fla_model.load_state_dict(weights, strict=True)
    assert_same_tensors(fla_model.state_dict(), weights)

    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    theirs, ours = fla_logits(folder, ids), our_logits(folder, ids)
    assert (theirs - ours).abs().max() <= 1e-5 * ours.abs().max()


def test_a_hybrid_export_is_an_fla_model_with_our_names_and_logits(hybrid_checkpoint, tmp_path,
                                                                    untimed_autotuning, flash_attn_reference):
    folder = tmp_path / "hf"
    assert main(["to-hf", str(hybrid_checkpoint), str(folder)]) == 0
    config = fla_models().GatedDeltaNetConfig.from_pretrained(folder)
    assert [spec["window_size"] for spec in config.attn] == [8, None]
    fla_model = fla_models().GatedDeltaNetForCausalLM.from_pretrained(folder)
    state = fla_model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embeddings.weight"].data_ptr()  # tied
    del state["lm_head.weight"]
    assert_same_tensors(state, read_folder(folder))
    # 24 tokens: past the window of 8, so a wrong window or RoPE layout would show
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs, ours = fla_logits(folder, ids), our_logits(folder, ids)
    assert (theirs - ours).abs().max() <= 1e-5 * ours.abs().max()


def test_a_folder_written_by_fla_converts_bit_exactly(tmp_path):
    # fla's own init and save_pretrained; no output gate (a plain RMSNorm closes each layer)
    models = fla_models()
    config = models.GatedDeltaNetConfig(hidden_size=32, num_heads=2, head_dim=8, num_hidden_layers=2,
                                        vocab_size=256, use_gate=False, hidden_ratio=2)
    torch.manual_seed(0)
    fla_model = models.GatedDeltaNetForCausalLM(config)
    assert_fla_folder_converts_bit_exactly(fla_model, tmp_path)


def test_transformers_generation_from_a_bpe_export_is_our_greedy_continuation(bpe_checkpoint, tmp_path,
                                                                               untimed_autotuning):
    """The export's tokenizer, generation_config.json and fla's recurrent cache in generate() give our
    greedy tokens (a one-step model: near ties are possible, so a few tokens; the GPU test goes on
    longer with a trained model)."""
    skip_unless_fla_generate_works()
    import transformers
    folder = tmp_path / "hf"
    assert main(["to-hf", str(bpe_checkpoint), str(folder)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    generation = transformers.GenerationConfig.from_pretrained(folder)
    prompt = torch.tensor([[tokenizer.bos_token_id]
                           + tokenizer("the quick brown", add_special_tokens=False).input_ids])
    expected, _ = greedy_continuation(model_from_hf(folder).eval(), prompt, 8, generation.eos_token_id)
    theirs = fla_models().GatedDeltaNetForCausalLM.from_pretrained(folder, fuse_norm=False,
                                                                   fuse_swiglu=False).eval()
    with torch.no_grad():
        generated = theirs.generate(prompt, generation_config=generation, max_new_tokens=8, do_sample=False)
    assert generated[0, prompt.shape[1]:].tolist() == expected
