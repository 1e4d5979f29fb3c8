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
from tests.op_counts import OpCounter
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



def _step_of_two(whole, group, autocast_dtype=None, **flags):
    """One train_step of two micro-batches with these ParallelModel sharing flags: (the gradients,
    the operators counted)."""
    parallel = parallelize(copy.deepcopy(whole), group)
    for name, value in flags.items():
        setattr(parallel, name, value)
    batches = packed_batches(_documents(30, seed=1), 16, 2, seed=2)
    with OpCounter() as counter:
        parallel.train_step([next(batches) for _ in range(2)], autocast_dtype=autocast_dtype)
    return {name: p.grad for name, p in parallel.model.named_parameters()}, counter.calls


def test_a_steps_microbatches_share_weight_casts(group_of_one):
    """Under autocast the micro-batches of a step share each weight's bf16 copy: one cast a weight a
    step, not one a micro-batch, and bit-identical gradients."""
    seed_torch(0)
    whole = HybridLM(model_config())
    alone, calls_alone = _step_of_two(whole, group_of_one, torch.bfloat16, share_weight_casts=False,
                                      accumulate_grads_in_place=False)
    shared, calls_shared = _step_of_two(whole, group_of_one, torch.bfloat16, share_weight_casts=True,
                                        accumulate_grads_in_place=False)
    for name, grad in shared.items():
        assert torch.equal(grad, alone[name]), name
    casts = torch.ops.aten._to_copy.default
    projections = sum(isinstance(m, torch.nn.Linear) for m in whole.modules()) - 1   # not the lm_head
    assert calls_alone[casts] - calls_shared[casts] == projections
    # what parallelize decides for this layout (step_sharing)
    assert parallelize(copy.deepcopy(whole), group_of_one).share_weight_casts
    recomputed = parallelize(copy.deepcopy(whole), group_of_one, activation_checkpointing="full")
    assert not recomputed.share_weight_casts


def test_later_microbatches_add_weight_gradients_in_place(group_of_one):
    """After the first micro-batch each projection's weight gradient is added into .grad by its
    product, with no accumulation pass of autograd's after it; the same sums to rounding."""
    seed_torch(0)
    whole = HybridLM(model_config())
    apart, calls_apart = _step_of_two(whole, group_of_one, accumulate_grads_in_place=False)
    in_place, calls_in_place = _step_of_two(whole, group_of_one, accumulate_grads_in_place=True)
    assert_close_set(in_place, apart, 1e-6, "gradients added in place")
    projections = sum(isinstance(m, torch.nn.Linear) for m in whole.modules()) - 1
    accumulations = torch.ops.aten.add_.Tensor
    assert calls_apart[accumulations] - calls_in_place[accumulations] == projections


def test_which_layouts_share_what_across_micro_batches():
    from gdn_parallel.parallel.parallelize import step_sharing
    plain = step_sharing(ParallelConfig(), "none", wrapped=False)
    assert plain == {"share_weight_casts": True, "accumulate_grads_in_place": True}
    # checkpointing: a shared copy would outlive each recomputed block
    assert step_sharing(ParallelConfig(), "full", wrapped=False)["share_weight_casts"] is False
    # FSDP2 gathers its weights in the compute dtype and reduces from accumulation hooks; DDP too
    fsdp = step_sharing(ParallelConfig(dp=2), "none", wrapped=True)
    assert fsdp == {"share_weight_casts": False, "accumulate_grads_in_place": False}
    ddp = step_sharing(ParallelConfig(dp=2, data_parallel="ddp"), "none", wrapped=True)
    assert ddp == {"share_weight_casts": True, "accumulate_grads_in_place": False}
    # pipeline stages under DDP run unwrapped, their gradients reduced after the step
    staged = step_sharing(ParallelConfig(dp=2, pp=2, data_parallel="ddp"), "none", wrapped=False)
    assert staged["accumulate_grads_in_place"] is True
