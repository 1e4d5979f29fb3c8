"""Our Kimi Delta Attention models in flash-linear-attention's KDAForCausalLM, and fla's KDA folders in ours.

As test_fla.py (its docstring): fla runs on the CPU in eval mode without gradients on at most 64 tokens,
where it takes its fused-recurrent KDA kernel, which Triton's interpreter runs; its attention layers
call flash-attn, for which test_fla.py's float64 reference attention stands in. The interpreter walks
the recurrence token by token for each row, value head and layer (about 25 ms a step), so the inputs
are short: one row of 24 tokens. Logits are compared at
1e-5 of their scale, and each comparison first shows that the KDA layers move the logits far beyond
that (a decay read with its key channels in another order), so the agreement is not that of layers
too small to matter.
"""
import json
from importlib.util import find_spec

import pytest
import torch

from gdn_parallel.config import Config, ModelConfig
from gdn_parallel.convert import ConvertError, model_from_hf
from gdn_parallel.convert.__main__ import main
from gdn_parallel.convert.hf_format import EMBEDDED, derived_model_config, hf_config
from gdn_parallel.convert.safetensors_io import read_folder
from gdn_parallel.model import KimiDeltaAttention

from .conftest import assert_fla_folder_converts_bit_exactly, assert_same_tensors

for _package, _name in (("transformers", "transformers"), ("fla", "flash-linear-attention")):
    if find_spec(_package) is None:
        pytest.skip(f"{_name} is not installed (pip install -e '.[dev]')", allow_module_level=True)

# test_fla.py's fixtures: the autotuner without timings, the reference attention in place of flash-attn
from .test_fla import flash_attn_reference, untimed_autotuning  # noqa: E402, F401

TOLERANCE = 1e-5   # of the logits' largest magnitude (fp32 on both sides)


def fla_models():
    """fla.models, imported by the tests that use it (importing fla takes seconds: test_fla.py)."""
    import fla.models
    return fla.models


def fla_logits(folder, ids) -> torch.Tensor:
    # fuse_* pick fla's fused Triton norms and SwiGLU, not weights: the plain PyTorch ones run faster here
    theirs = fla_models().KDAForCausalLM.from_pretrained(folder, fuse_norm=False, fuse_swiglu=False).eval()
    with torch.no_grad():
        return theirs(ids).logits


def our_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def assert_kda_layers_matter(model, ids, reference: torch.Tensor) -> None:
    """Reversing the key channels of every KDA layer's dt_bias (a decay read in the wrong layout) moves
    the logits by over 100 times the tolerance."""
    with torch.no_grad():
        for mixer in (m for m in model.modules() if isinstance(m, KimiDeltaAttention)):
            mixer.dt_bias.copy_(mixer.dt_bias.view(mixer.num_v_heads, -1).flip(-1).flatten())
        moved = (our_logits(model, ids) - reference).abs().max()
    assert moved > 100 * TOLERANCE * reference.abs().max(), float(moved)


def assert_same_logits(theirs: torch.Tensor, ours: torch.Tensor) -> None:
    assert (theirs - ours).abs().max() <= TOLERANCE * ours.abs().max()


@pytest.mark.usefixtures("untimed_autotuning")
def test_a_pure_kda_export_loads_into_fla_strictly_and_gives_our_logits(kda_checkpoint, tmp_path):
    folder = tmp_path / "hf"
    assert main(["to-hf", str(kda_checkpoint), str(folder)]) == 0
    hf = json.loads((folder / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["allow_neg_eigval"]) == \
        ("kda", ["KDAForCausalLM"], True)
    weights = read_folder(folder)
    models = fla_models()
    fla_model = models.KDAForCausalLM(models.KDAConfig.from_pretrained(folder))
    fla_model.load_state_dict(weights, strict=True)
    assert_same_tensors(fla_model.state_dict(), weights)

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    ours = model_from_hf(folder)
    expected = our_logits(ours, ids)
    assert_same_logits(fla_logits(folder, ids), expected)
    assert_kda_layers_matter(ours, ids, expected)


@pytest.mark.usefixtures("untimed_autotuning", "flash_attn_reference")
def test_a_kda_hybrid_export_is_an_fla_model_with_our_names_and_logits(kda_hybrid_checkpoint, tmp_path):
    folder = tmp_path / "hf"
    assert main(["to-hf", str(kda_hybrid_checkpoint), str(folder)]) == 0
    config = fla_models().KDAConfig.from_pretrained(folder)
    assert [(spec["layers"], spec["window_size"], spec["num_kv_heads"]) for spec in config.attn] == \
        [([1], 8, 1), ([2], None, 1)]
    fla_model = fla_models().KDAForCausalLM.from_pretrained(folder)
    state = fla_model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embeddings.weight"].data_ptr()  # tied
    del state["lm_head.weight"]
    assert_same_tensors(state, read_folder(folder))
    # 24 tokens: past the window of 8, so a wrong window or RoPE layout would show
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    ours = model_from_hf(folder)
    expected = our_logits(ours, ids)
    assert_same_logits(fla_logits(folder, ids), expected)
    assert_kda_layers_matter(ours, ids, expected)


@pytest.mark.usefixtures("untimed_autotuning")
def test_a_kda_folder_written_by_fla_converts_bit_exactly_and_gives_fla_logits(tmp_path):
    # fla's own init (wider than its default, so its KDA layers matter) and save_pretrained; grouped
    # value heads and negative eigenvalues; a vocabulary of 256 for our default byte-level data
    models = fla_models()
    config = models.KDAConfig(hidden_size=64, num_heads=2, num_v_heads=4, head_dim=32, num_hidden_layers=2,
                              vocab_size=256, hidden_ratio=2, allow_neg_eigval=True, initializer_range=0.1)
    torch.manual_seed(0)
    fla_model = models.KDAForCausalLM(config)
    assert_fla_folder_converts_bit_exactly(fla_model, tmp_path)

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = fla_model.eval()(ids).logits
    ours = model_from_hf(tmp_path / "fla")
    reference = our_logits(ours, ids)
    assert_same_logits(theirs, reference)
    assert_kda_layers_matter(ours, ids, reference)


# ---------------------------------------------------------------------------- refusals
TINY_KDA = dict(vocab_size=256, hidden_size=64, n_layers=2, layer_pattern="KA", kda_num_heads=2,
                kda_head_dim=32, attn_num_heads=2)


@pytest.mark.parametrize("changes, needle", [
    ({"attn_rotary_dim": 0}, "model.attn_rotary_dim=0"),           # the attention of configs/kimi-1.3b.yaml
    ({"attn_rotary_dim": 16}, "model.attn_rotary_dim=16"),
    ({"attn_output_gate": True}, "model.attn_output_gate"),
    ({"attn_qk_norm": True}, "model.attn_qk_norm"),
    ({"attn_head_dim": 16}, "model.attn_head_dim"),
    ({"conv_bias": True}, "model.conv_bias"),
    ({"layer_pattern": "KG"}, "G in model.layer_pattern"),        # no fla model holds GDN and KDA layers
])
def test_what_fla_kda_cannot_express_is_refused_by_name(changes, needle):
    with pytest.raises(ConvertError, match="KDAForCausalLM cannot express") as refused:
        hf_config(ModelConfig(**{**TINY_KDA, **changes}), torch.float32)
    assert needle in str(refused.value)


def test_the_kimi_config_is_refused_for_its_attention_without_rope():
    model = Config.from_yaml("configs/kimi-1.3b.yaml").model
    with pytest.raises(ConvertError, match="model.attn_rotary_dim=0: fla's Attention always rotates"):
        hf_config(model, torch.bfloat16)


def test_a_kda_model_round_trips_through_fla_fields_alone():
    model = ModelConfig(**{**TINY_KDA, "kda_num_v_heads": 4, "kda_allow_neg_eigval": True})
    hf = hf_config(model, torch.float32)
    del hf[EMBEDDED]
    derived = derived_model_config(hf, "config.json")
    assert (derived.layer_types, derived.kda_v_heads, derived.kda_allow_neg_eigval) == ("KA", 4, True)


@pytest.mark.parametrize("field, value, needle", [
    ("lower_bound", -5.0, "lower_bound=-5.0"), ("safe_gate", True, "safe_gate=True"),
    ("use_short_conv", False, "use_short_conv"), ("hidden_act", "gelu", "hidden_act"),
    ("attnres_block_size", 2, "attnres_block_size"),
    ("num_heads", 3, "model.kda_num_heads is num_heads"),   # 4 value heads: not a multiple of 3
])
def test_fla_kda_models_we_cannot_build_are_refused_by_name(field, value, needle):
    hf = {**hf_config(ModelConfig(**{**TINY_KDA, "kda_num_v_heads": 4}), torch.float32), field: value}
    del hf[EMBEDDED]
    with pytest.raises(ConvertError, match="cannot build") as refused:
        derived_model_config(hf, "config.json")
    assert needle in str(refused.value)
