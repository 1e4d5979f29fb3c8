"""Which layouts gdn-verify checks: the enumeration of pp x dp x cp x tp, the variants, the names
`--layouts` reads, and the errors that say what to write instead (no processes)."""
import pytest

from gdn_parallel.config import Config, ModelConfig
from gdn_parallel.verify.layouts import (
    DIMS,
    Layout,
    LayoutError,
    base_layouts,
    default_layouts,
    factorisations,
    layouts_to_run,
    parse_layout,
    parse_layouts,
    unsupported_reason,
)
from tests.verify.helpers import LAYOUTS, OLD_NAMES

TINY = Config.from_yaml("configs/tiny-cpu.yaml").model
ROW = 512
# a model every layout of 8 fits: 8 heads everywhere, 8 layers
WIDE = ModelConfig(n_layers=8, gdn_num_heads=8, attn_num_heads=8, vocab_size=256)


def product(f):
    pp, dp, cp, tp = f
    return pp * dp * cp * tp


@pytest.mark.parametrize("n, count", [(1, 1), (2, 4), (3, 4), (4, 10), (6, 16), (8, 20), (16, 35)])
def test_factorisations_are_every_ordered_product(n, count):
    found = factorisations(n)
    assert len(found) == len(set(found)) == count
    assert all(product(f) == n for f in found)
    brute = {(a, b, c, d) for a in range(1, n + 1) for b in range(1, n + 1) for c in range(1, n + 1)
             for d in range(1, n + 1) if a * b * c * d == n}
    assert set(found) == brute


def test_base_layouts_put_single_dimensions_first():
    names = [l.name for l in base_layouts(4)]
    assert names[:4] == ["tp4", "pp4", "dp4", "cp4"]
    assert len(names) == 10 and len(set(names)) == 10
    assert [l.name for l in base_layouts(1)] == ["pp1,dp1,cp1,tp1"]


@pytest.mark.parametrize("n, model, expected", [
    (2, TINY, ["tp2", "pp2", "dp2", "cp2", "cp2,allgather", "dp2,ddp", "pp2,interleaved", "tp2,sp",
               "cp2,ac=full", "dp2,ac=full,offload"]),
    (4, TINY, ["tp4", "pp4", "dp4", "cp4", "pp2,tp2", "dp2,tp2", "cp2,tp2", "pp2,dp2", "pp2,cp2", "dp2,cp2",
               "pp2,cp2,allgather", "pp2,dp2,ddp", "pp2,cp2,interleaved", "cp2,tp2,sp", "pp2,cp2,ac=full",
               "pp2,dp2,ac=full,offload"]),
])
def test_default_set(n, model, expected):
    chosen = default_layouts(n, model, ROW)
    assert [l.name for l, _ in chosen] == expected
    skipped = {l.name: reason for l, reason in chosen if reason}
    if n == 4:   # the tiny model has 2 GDN heads: tp4 cannot split them
        assert list(skipped) == ["tp4"] and "model.gdn_num_heads=2" in skipped["tp4"]
    else:
        assert not skipped


def test_default_set_of_eight_has_every_factorisation_and_each_variant_once():
    chosen = default_layouts(8, WIDE, ROW)
    assert not [l for l, reason in chosen if reason]
    bases = [l for l, _ in chosen if l == Layout(l.pp, l.dp, l.cp, l.tp)]
    assert len(bases) == 20
    variants = [l for l, _ in chosen if l not in bases]
    assert [v.name for v in variants] == ["pp2,cp4,allgather", "pp2,dp4,ddp", "pp4,cp2,interleaved",
                                          "cp2,tp4,sp", "pp2,cp4,ac=full", "pp2,dp4,ac=full,offload"]


def test_a_variant_moves_to_a_layout_the_model_takes():
    """tiny has 4 layers: pp4 with 2 virtual stages would need 8, so interleaved goes to pp2."""
    names = [l.name for l, reason in default_layouts(8, TINY, ROW) if not reason]
    assert "pp2,cp4,interleaved" in names and "pp8" not in names


@pytest.mark.parametrize("text, expected", [
    ("tp2,cp2", Layout(tp=2, cp=2)),
    ("pp=2,dp=2", Layout(pp=2, dp=2)),
    ("tp2_cp2", Layout(tp=2, cp=2)),
    ("PP2, dp2 ,ddp", Layout(pp=2, dp=2, data_parallel="ddp")),
    ("cp4,allgather,ac=full", Layout(cp=4, cp_algorithm="allgather", activation_checkpointing="full")),
    ("pp2,interleaved", Layout(pp=2, pp_schedule="interleaved", virtual_stages=2)),
    ("pp2,interleaved,vs=3", Layout(pp=2, pp_schedule="interleaved", virtual_stages=3)),
    ("tp2,sp,cp_algorithm=allgather,data_parallel=ddp", Layout(tp=2, sequence_parallel=True,
                                                              cp_algorithm="allgather", data_parallel="ddp")),
    ("pp2_1f1b", Layout(pp=2)),
    ("cp4,zigzag", Layout(cp=4, cp_attention_split="zigzag")),
    ("cp2,cp_attention_split=zigzag,allgather", Layout(cp=2, cp_attention_split="zigzag",
                                                       cp_algorithm="allgather")),
    ("pp2,dp2,ac=full,offload", Layout(pp=2, dp=2, activation_checkpointing="full",
                                       activation_offload="cpu")),
])
def test_parse_layout(text, expected):
    assert parse_layout(text) == expected


@pytest.mark.parametrize("layout", [l for n in (1, 2, 4, 8) for l, _ in default_layouts(n, WIDE, ROW)]
                         + [Layout(pp=2, pp_schedule="interleaved", virtual_stages=3)], ids=lambda l: l.name)
def test_names_read_back(layout):
    assert parse_layout(layout.name) == layout


@pytest.mark.parametrize("text, message", [
    ("tp2,xx", "cannot read 'xx'"),
    ("tp2,tp4", "sets tp twice"),
    ("tp0", "at least 1"),
    ("cp2,ac=sometimes", "ac=sometimes is not one of"),
    ("dp2,offload", "add ac=full"),
    ("pp2,vs=2", "needs parallel.pp_schedule=interleaved"),
    ("", "empty layout"),
])
def test_bad_layouts_say_what_to_write(text, message):
    with pytest.raises(LayoutError, match=message):
        parse_layout(text)


def test_layouts_of_another_world_size_are_refused_with_an_example():
    with pytest.raises(LayoutError, match=r"uses pp\*dp\*cp\*tp = 2 processes but the job has 4.*dp2,tp2"):
        parse_layouts(["tp2"], 4)


def test_several_layouts_in_one_argument_and_duplicates():
    assert [l.name for l in parse_layouts(["tp2,cp2;pp2,dp2", "cp2,tp2"], 4)] == ["cp2,tp2", "pp2,dp2"]


def test_given_layouts_must_fit_the_model():
    with pytest.raises(LayoutError, match="tp4.*gdn_num_heads"):
        layouts_to_run(["tp4"], 4, TINY, ROW)
    assert unsupported_reason(Layout(cp=2, tp=4, sequence_parallel=True), WIDE, 12) is not None
    assert [l.name for l, _ in layouts_to_run(["cp2,tp2,sp"], 4, TINY, ROW)] == ["cp2,tp2,sp"]
    # 12 tokens make 4 shards of 3, which zigzag cannot halve into query blocks
    assert unsupported_reason(Layout(cp=4), TINY, 12) is None
    assert "2 x cp = 8 equal query blocks" in unsupported_reason(Layout(cp=4, cp_attention_split="zigzag"),
                                                                 TINY, 12)


def test_old_tool_names_keep_their_meaning():
    assert set(LAYOUTS) == set(OLD_NAMES)
    assert LAYOUTS["pp2_interleaved"]["virtual_stages"] == 2
    assert LAYOUTS["cp2_allgather"]["cp_algorithm"] == "allgather"
    assert LAYOUTS["tp2_sp"]["sequence_parallel"] is True
    assert all(set(LAYOUTS[n]) == {*DIMS, "sequence_parallel", "cp_algorithm", "cp_attention_split",
                                   "data_parallel", "fsdp_reshard_after_forward", "pp_schedule",
                                   "virtual_stages"} for n in OLD_NAMES)


def test_the_word_default_adds_the_default_set_to_the_named_layouts():
    defaults = [layout.name for layout, _ in layouts_to_run(None, 4, TINY, ROW)]
    assert "cp4,allgather" not in defaults and "dp4" in defaults
    both = [layout.name for layout, _ in layouts_to_run(["default", "cp4,allgather;dp4"], 4, TINY, ROW)]
    assert both == defaults + ["cp4,allgather"]      # a named layout of the default set runs once
    with pytest.raises(LayoutError, match="without a layout"):
        layouts_to_run([" "], 4, TINY, ROW)
