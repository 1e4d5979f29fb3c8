"""The line that says how an uneven pipeline split put the layers on the stages (issue 44, item 4: 3
layers over pp=2 were split without a word); an even split, or no pipeline, says nothing."""
from gdn_parallel.config import ModelConfig, ParallelConfig
from gdn_parallel.parallel.pipeline import parts_of_rank, stage_layer_ranges, uneven_split_line

SMALL = dict(hidden_size=128, gdn_num_heads=2, gdn_head_dim=32, attn_num_heads=4, window_size=64)


def test_three_layers_over_two_stages_are_said():
    model = ModelConfig(n_layers=3, layer_pattern="GSG", **SMALL)
    line = uneven_split_line(model, ParallelConfig(pp=2), 256)
    assert line.startswith("pipe  | model.n_layers=3 over 2 stages, unevenly (balanced by cost")
    assert line.endswith(": stage 0: layers 0-1, stage 1: layer 2")
    # the line tells the split the ranks build
    assert {f"layers.{i}" for i in (0, 1)} <= parts_of_rank(model, ParallelConfig(pp=2), 0, 256)
    assert "layers.2" in parts_of_rank(model, ParallelConfig(pp=2), 1, 256)


def test_interleaved_stages_name_their_pp_rank():
    model = ModelConfig(n_layers=5, layer_pattern="G")
    parallel = ParallelConfig(pp=2, pp_schedule="interleaved", virtual_stages=2)
    line = uneven_split_line(model, parallel, 256)
    ranges = stage_layer_ranges(model, 4, 256)
    assert "over 4 stages" in line and line.count("(pp rank ") == 4
    assert "stage 3 (pp rank 1): layer" in line and sum(end - start for start, end in ranges) == 5


def test_even_splits_and_single_stages_say_nothing():
    model = ModelConfig(n_layers=4, **SMALL)
    assert stage_layer_ranges(model, 2, 256) == [(0, 2), (2, 4)]
    assert uneven_split_line(model, ParallelConfig(pp=2), 256) is None
    assert uneven_split_line(ModelConfig(n_layers=3, layer_pattern="GSG"), ParallelConfig(), 256) is None
