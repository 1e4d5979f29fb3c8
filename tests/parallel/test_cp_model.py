"""HybridLM (G, K, S and A layers) under context parallelism equals one process: loss, every
parameter gradient, and the parameters after a few AdamW steps."""
import copy

import pytest
import torch

from gdn_parallel.config import ModelConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.batch import shard_batch
from tests.compare import assert_close_set, rel_err
from tests.parallel.batches import cp_step, make_batch
from tests.parallel.launcher import run_workers
from tests.seeds import seed_torch

TOTAL = 48


def model_config(algorithm_window, layer_pattern="GSA"):
    return ModelConfig(vocab_size=64, hidden_size=32, n_layers=3, layer_pattern=layer_pattern,
                       gdn_num_heads=2, gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4,
                       attn_num_kv_heads=2, window_size=algorithm_window, gdn_chunk_size=8,
                       intermediate_size=48, kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=8,
                       kda_chunk_size=8)


def train_equal(rank, world, algorithm, window, layer_pattern="GSA"):
    seed_torch(0)
    reference = HybridLM(model_config(window, layer_pattern)).double()
    model = copy.deepcopy(reference)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    layouts = [[0, TOTAL], [0, 5, 19, 20, 40, TOTAL], [0, 1, 30, 31, TOTAL]]
    for step, cu in enumerate(layouts):
        batch = make_batch(cu, seed=step)
        out = reference(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()

        total_loss = cp_step(model, batch, rank, world, algorithm)

        tag = f"{layer_pattern} {algorithm} window={window} step={step} rank={rank}"
        assert rel_err(total_loss, out.loss.detach()) < 1e-12, tag   # a loss near log(vocab)
        assert_close_set({n: p.grad for n, p in model.named_parameters()},
                         {n: p.grad for n, p in reference.named_parameters()}, 1e-9, f"grads, {tag}")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_close_set({n: p.detach() for n, p in model.named_parameters()},
                         {n: p.detach() for n, p in reference.named_parameters()}, 1e-9, f"after step, {tag}")
    return True


def all_model_cases(rank, world):
    for algorithm in ("relay", "allgather"):
        train_equal(rank, world, algorithm, window=5)
    train_equal(rank, world, "relay", window=30)   # SWA halo over several ranks at CP=4
    for algorithm in ("relay", "allgather"):        # Kimi Delta Attention's state, as GDN's
        train_equal(rank, world, algorithm, window=5, layer_pattern="KKA")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_cp_hybrid_lm_matches_single_process(world):
    assert all(run_workers(all_model_cases, world))


def test_shard_batch_validates_the_split():
    batch = make_batch([0, TOTAL], 0)
    with pytest.raises(ValueError, match="train.seq_len \\* train.batch_size = 48 is not divisible by "
                                         "parallel.cp=5"):
        shard_batch(batch, 0, 5)
    with pytest.raises(ValueError, match="shorter than one token"):
        shard_batch(make_batch([0, TOTAL], 0), 0, 96)
    shard = shard_batch(batch, 1, 4)
    assert shard.input_ids.shape == (1, 12) and shard.num_label_tokens == TOTAL - 1
    assert shard.context.continues_from_prev and shard.context.continues_to_next
