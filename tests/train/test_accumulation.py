"""Gradient accumulation (train.microbatch_size): a batch split into micro-batches trains exactly as
the whole batch does (CPU, fp32): per-step losses and the parameters after the steps."""
import copy

import pytest
import torch
import torch.distributed as dist

from gdn_parallel.config import Config, ConfigError, ParallelConfig, TrainConfig
from gdn_parallel.data.packing import packed_batches
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.mesh import build_mesh
from gdn_parallel.parallel.parallelize import parallelize
from gdn_parallel.train import run_training
from tests.compare import assert_close_set
from tests.parallel.test_layouts import model_config
from tests.seeds import generator, seed_torch


def _documents(count, seed):
    gen = generator(seed)
    return [torch.randint(0, 64, (int(n),), generator=gen)
            for n in torch.randint(5, 40, (count,), generator=gen)]


@pytest.fixture
def group_of_one():
    """The trainer's single-process group (gloo, in-memory store)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_mesh(ParallelConfig(), "cpu")
    dist.destroy_process_group()


def test_split_batch_gives_the_same_gradients_and_update(group_of_one):
    seed_torch(0)
    whole = HybridLM(model_config())
    documents = _documents(30, seed=1)
    results = {}
    for micro in (4, 2, 1):
        parallel = parallelize(copy.deepcopy(whole), group_of_one)  # what the trainer steps through
        model = parallel.model
        # SGD: the parameters then carry the accumulated gradients exactly. (AdamW's first update is
        # lr * g / |g| per element, which turns a gradient element at rounding level into a full step
        # of either sign; the loop test below trains with AdamW and compares the losses.)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batches = packed_batches(documents, 16, micro, seed=2)
        losses, grads = {}, {}
        for step in range(2):
            microbatches = [next(batches) for _ in range(4 // micro)]
            losses[f"loss{step}"] = parallel.train_step(microbatches)
            grads.update({f"{name} grad{step}": p.grad.clone() for name, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results[micro] = (losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()})
    for micro in (2, 1):
        for what, got, want in zip(("losses", "gradients", "parameters"), results[micro], results[4]):
            assert_close_set(got, want, 1e-5, f"{what}, micro-batches of {micro}")


def test_training_loop_losses_match_with_and_without_accumulation():
    base = ["model.n_layers=2", "train.steps=3", "train.warmup_steps=1", "train.log_every=1",
            "train.batch_size=4", "train.seq_len=64", "train.eval_rows=2"]
    losses = {}
    for micro in (0, 2):
        config = Config().with_overrides(base + [f"train.microbatch_size={micro}"]).validate()
        losses[micro] = run_training(config, print_fn=lambda line: None)["losses"]
    assert len(losses[0]) == 3
    assert_close_set({f"step{i}": torch.tensor(v) for i, v in enumerate(losses[2])},
                     {f"step{i}": torch.tensor(v) for i, v in enumerate(losses[0])}, 1e-5, "per-step losses")


def test_microbatch_size_must_divide_the_batch():
    with pytest.raises(ConfigError, match="train.microbatch_size"):
        TrainConfig(batch_size=8, microbatch_size=3).validate()
    with pytest.raises(ConfigError, match="train.microbatch_size"):
        TrainConfig(microbatch_size=-1).validate()
