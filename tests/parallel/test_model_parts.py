"""Under pipeline parallelism a rank builds and holds only its stages' weights (plus the embedding on
the first stage, the final norm and head on the last), with the values a single device has there."""
import torch

from gdn_parallel.config import ModelConfig, ParallelConfig
from gdn_parallel.model import build_model
from gdn_parallel.parallel.pipeline import parts_of_rank
from tests.parallel.launcher import run_workers


def bytes_of(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def pp_rank_case(rank, world):
    # 8 equal blocks, a vocabulary large enough that the embedding and the head matter
    config = ModelConfig(vocab_size=2048, hidden_size=64, n_layers=8, layer_pattern="G", gdn_num_heads=2,
                         gdn_head_dim=16, intermediate_size=128)
    parts = parts_of_rank(config, ParallelConfig(pp=world), rank, seq_len=256)
    local = build_model(config, "cpu", seed=3, keep=parts.__contains__)
    whole = build_model(config, "cpu", seed=3)
    block = bytes_of(whole.layers[0])
    embedding = whole.embeddings.weight.numel() * 4
    head = embedding + whole.norm.weight.numel() * 4
    # each rank: half of the blocks, plus the embedding (first) or the norm and head (last)
    expected = 4 * block + (embedding if rank == 0 else head)
    assert bytes_of(local) == expected, (rank, bytes_of(local), expected, bytes_of(whole))
    assert bytes_of(local) < 0.55 * bytes_of(whole)
    held = dict(local.named_parameters())
    for name, p in whole.named_parameters():
        if name in held:
            assert torch.equal(held[name], p), name
    return sorted(parts)


def test_each_pipeline_rank_holds_only_its_stage():
    first, last = run_workers(pp_rank_case, 2)
    assert "embeddings" in first and "lm_head" not in first
    assert "lm_head" in last and "embeddings" not in last
    assert not set(first) & set(last)
