"""Data parallelism (FSDP2 / DDP over dp, gradients summed over dp x cp) equals one process computing
the global-mean loss over every dp replica's batch: loss, every parameter gradient, the global
gradient norm and clipping, and the parameters after two AdamW steps."""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gdn_parallel.config import ModelConfig, ParallelConfig
from gdn_parallel.model import HybridLM, blocks_of
from gdn_parallel.parallel.batch import cp_loss, shard_batch
from gdn_parallel.parallel.data_parallel import (
    apply_data_parallel,
    clip_grad_norm,
    global_label_count,
    global_label_normalizer,
)
from gdn_parallel.parallel.mesh import build_mesh
from tests.compare import assert_close_set, rel_err
from tests.parallel.batches import make_batch
from tests.parallel.launcher import SharedLaunch, run_workers
from tests.seeds import generator, seed_torch

TOTAL = 48
# LAYOUTS[step][dp replica]: document boundaries of each replica's packed row
LAYOUTS = [[[0, 5, 19, 20, 40, TOTAL], [0, 1, 30, 31, TOTAL]],
           [[0, TOTAL], [0, 7, 24, 41, TOTAL]]]
MAX_NORMS = [0.05, 1e4]   # step 0 clips, step 1 does not


def model_config():
    return ModelConfig(vocab_size=64, hidden_size=32, n_layers=3, layer_pattern="GSA", gdn_num_heads=2,
                       gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2,
                       window_size=5, gdn_chunk_size=8, intermediate_size=48)


def full(t):
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single", "barrier")


@contextlib.contextmanager
def record_collectives(calls):
    """Record the ranks of the group of every torch.distributed collective called inside."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def spy(name, fn):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            calls.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return fn(*args, **kwargs)
        return call
    for name, fn in saved.items():
        setattr(dist, name, spy(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def train_equal(rank, world, mode, dp, cp):
    seed_torch(0)
    reference = HybridLM(model_config()).double()
    model = copy.deepcopy(reference)
    dims = build_mesh(ParallelConfig(dp=dp, cp=cp, data_parallel=mode), "cpu")
    wrapped = apply_data_parallel(model, dims)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    d, c = dims.rank("dp"), dims.rank("cp")
    for step, (layouts, max_norm) in enumerate(zip(LAYOUTS, MAX_NORMS)):
        batches = [make_batch(cu, seed=10 * step + r) for r, cu in enumerate(layouts[:dp])]
        # one process: the global mean over every replica's batch
        outs = [reference(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens) for b in batches]
        ref_loss = sum(o.loss_sum for o in outs) / sum(o.num_tokens for o in outs)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)

        batch = batches[d]
        if cp > 1:
            shard = shard_batch(batch, c, cp, group=dims.group("cp"))
            count = global_label_count(shard.num_label_tokens, dims)
            with record_collectives([]) as calls:
                loss = cp_loss(wrapped, shard) * (shard.num_label_tokens / count)
            # docs/design.md §2: data parallelism puts no collective over cp in the forward (parameter
            # all-gathers stay in dp). The one cp collective left is the model's own: the K/V
            # all-gather of the full-attention ('A') layer.
            dp_ranks = tuple(dist.get_process_group_ranks(dims.group("dp")))
            cp_ranks = tuple(dist.get_process_group_ranks(dims.group("cp")))
            calls = [c for c in calls if c != ("all_gather", cp_ranks)]
            assert all(ranks == dp_ranks for _, ranks in calls), (calls, dp_ranks)
            assert mode == "ddp" or dp == 1 or any("all_gather" in name for name, _ in calls), calls
        else:
            out = wrapped(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
            count = global_label_count(out.num_tokens, dims)
            loss = out.loss_sum / count
        loss.backward()
        if cp > 1:
            shard.context.finish()
        assert count == sum(o.num_tokens for o in outs)
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)

        tag = f"{mode} dp={dp} cp={cp} step={step} rank={rank}"
        assert rel_err(total_loss, ref_loss.detach()) < 1e-12, tag   # a loss near log(vocab)
        assert_close_set({n: full(p.grad) for n, p in model.named_parameters()}, ref_grads, 1e-9,
                         f"grads, {tag}")
        norm = clip_grad_norm(model.parameters(), max_norm, dims)
        assert rel_err(norm, ref_norm) < 1e-12, f"grad norm {norm} vs {ref_norm}, {tag}"
        assert (ref_norm > max_norm) == (step == 0), "step 0 must clip, step 1 must not"
        assert_close_set({n: full(p.grad) for n, p in model.named_parameters()},
                         {n: p.grad for n, p in reference.named_parameters()}, 1e-9, f"clipped grads, {tag}")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_close_set({n: full(p) for n, p in model.named_parameters()},
                         {n: p.detach() for n, p in reference.named_parameters()}, 1e-9, f"after step, {tag}")
    return True


def two_process_cases(rank, world):
    for mode in ("fsdp", "ddp"):
        train_equal(rank, world, mode, dp=2, cp=1)
        train_equal(rank, world, mode, dp=1, cp=2)   # HSDP with a dp group of one
    return True


def dp2_cp2_cases(rank, world):
    for mode in ("fsdp", "ddp"):
        train_equal(rank, world, mode, dp=2, cp=2)
    return True


def _gathered_step(rank, world):
    """Two steps of two micro-batches each through ParallelModel, FSDP2 over dp=2, with the parameters
    resharded after every pass (the default) and kept gathered for a step: the FSDP all-gathers each
    layout makes in a step, and its parameters and gradients (float64: the two must agree exactly)."""
    from gdn_parallel.parallel.parallelize import parallelize
    results = {}
    for keep_gathered in (False, True):
        seed_torch(0)
        model = HybridLM(model_config()).double()
        config = ParallelConfig(dp=2, fsdp_reshard_after_forward=not keep_gathered)
        parallel = parallelize(model, build_mesh(config, "cpu"), config)
        opt = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
        gathers = []
        for step, layouts in enumerate(LAYOUTS):
            microbatches = [make_batch(cu, seed=10 * step + 2 * rank + i) for i, cu in enumerate(layouts)]
            with record_collectives([]) as calls:
                parallel.train_step(microbatches)
            gathers.append(sum("all_gather" in name for name, _ in calls))
            grads = {n: full(p.grad).clone() for n, p in parallel.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {n: full(p).clone() for n, p in parallel.named_parameters()}
        results[keep_gathered] = (gathers, grads, params)
    (resharding, grads, params), (kept, kept_grads, kept_params) = results[False], results[True]
    units = len(blocks_of(model)) + 1    # every block, and the root (embeddings, final norm, lm_head)
    assert kept == [units, units], (kept, units)            # each unit gathered once a step
    assert all(r > 2 * k for r, k in zip(resharding, kept)), (resharding, kept)
    assert_close_set(kept_grads, grads, 1e-12, "gradients of the last step, kept gathered")
    assert_close_set(kept_params, params, 1e-12, "parameters after two steps, kept gathered")
    return resharding, kept


class _Block(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())

    def forward(self, cw, cb):
        return (self.weight * cw).sum() + (self.bias * cb).sum()


class _Stage(nn.Module):
    """A pipeline-stage-like module: its one block in a ModuleDict `layers`."""

    def __init__(self, weight, bias):
        super().__init__()
        self.layers = nn.ModuleDict({"3": _Block(weight, bias)})

    def forward(self, cw, cb):
        return self.layers["3"](cw, cb)


def clip_cases(rank, world):
    """clip_grad_norm over pp x tp (plain tensors) and over FSDP2 dp x tp, against torch's
    clip_grad_norm_ on the full single-device gradients."""
    gen = generator(1)
    # (a) pp=2 x tp=2: per stage one replicated [3, 4] and one tp-sharded [4, 6] (dim 1) gradient
    dims = build_mesh(ParallelConfig(pp=2, tp=2), "cpu")
    stage, t = dims.rank("pp"), dims.rank("tp")
    reps = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    shards = [torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    ref = [nn.Parameter(torch.zeros_like(g)) for g in reps + shards]
    for p, g in zip(ref, reps + shards):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    mine = [nn.Parameter(torch.zeros(3, 4, dtype=torch.float64)),
            nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))]
    mine[0].grad = reps[stage].clone()
    mine[1].grad = shards[stage][:, 3 * t:3 * t + 3].clone()
    mine[1]._tp_shard_dim = 1
    norm = clip_grad_norm(mine, 1.0, dims)
    assert ref_norm > 1.0 and rel_err(norm, ref_norm) < 1e-12, (norm, ref_norm)
    assert rel_err(mine[0].grad, ref[stage].grad) < 1e-12
    assert rel_err(mine[1].grad, ref[2 + stage].grad[:, 3 * t:3 * t + 3]) < 1e-12

    # (b) FSDP2 over dp=2 x tp=2 on a stage module: weight [4, 6] sharded over tp on dim 0
    # (marked before fully_shard: the mark must survive it), bias [6] replicated over tp.
    # dp rank d's loss has gradient C_d, so the summed gradient is C_0 + C_1.
    dims = build_mesh(ParallelConfig(dp=2, tp=2), "cpu")
    d, t = dims.rank("dp"), dims.rank("tp")
    cws = [torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    cbs = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(2)]
    module = _Stage(torch.zeros(2, 6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64))
    module.layers["3"].weight._tp_shard_dim = 0
    module = apply_data_parallel(module, dims)
    module(cws[d][2 * t:2 * t + 2], cbs[d]).backward()
    ref = [nn.Parameter(torch.zeros(4, 6, dtype=torch.float64)),
           nn.Parameter(torch.zeros(6, dtype=torch.float64))]
    ref[0].grad, ref[1].grad = cws[0] + cws[1], cbs[0] + cbs[1]
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    weight, bias = module.layers["3"].weight, module.layers["3"].bias
    assert weight._tp_shard_dim == 0 and type(weight.grad).__name__ == "DTensor"
    norm = clip_grad_norm(module.parameters(), 0.5, dims)
    assert ref_norm > 0.5 and rel_err(norm, ref_norm) < 1e-12, (norm, ref_norm)
    assert rel_err(full(weight.grad), ref[0].grad[2 * t:2 * t + 2]) < 1e-12
    assert rel_err(full(bias.grad), ref[1].grad) < 1e-12
    return True


def test_dp2_and_cp2_fsdp_and_ddp_match_single_process():
    assert all(DP_CASES("dp2_cp2_two_process"))


def test_fsdp_kept_gathered_gathers_once_a_step_and_trains_the_same():
    resharding, kept = DP_CASES("gathered")[0]
    print(f"FSDP all-gathers a step: {resharding} resharding after each pass, {kept} kept gathered")


def test_dp2_cp2_fsdp_and_ddp_match_single_process():
    assert all(DP_CASES("dp2_cp2"))


def test_clip_grad_norm_over_pp_tp_and_fsdp_tp():
    assert all(DP_CASES("clip"))


def test_unknown_data_parallel_mode_is_rejected():
    from gdn_parallel.parallel.data_parallel import apply_data_parallel as apply

    class Dims:
        config = ParallelConfig()
    config = ParallelConfig()
    config.data_parallel = "zero3"
    with pytest.raises(ValueError, match="parallel.data_parallel='zero3'"):
        apply(nn.Linear(2, 2), Dims(), config)


def _normalizers(rank, world_size):
    dims = build_mesh(ParallelConfig(dp=world_size), "cpu")
    counts = {0: [3, 0], 1: [5, 0]}[rank] if world_size == 2 else [7, 0]
    return [(type(g).__name__, int(g)) for g in (global_label_normalizer(c, dims) for c in counts)]


def test_the_loss_normalizer_stays_on_the_device_over_dp():
    """Over dp replicas the step's divisor is an all-reduced tensor, never a host number (which would be
    a device read on a GPU): the labels summed, at least 1; with dp = 1 the host's own count."""
    assert DP_CASES("normalizers") == [[("Tensor", 8), ("Tensor", 1)]] * 2
    assert run_workers(_normalizers, 1) == [[("int", 7), ("int", 1)]]


# ---------------------------------------------------------------- the DDP comm hook's future
class _QueuedSum(torch.futures.Future):
    """A collective's future as NCCL's behaves: complete as soon as the collective is queued, its sum
    there only for a reader that waits on this future (here the sum lands when wait() is called; on
    a GPU it lands when the NCCL stream gets to it, and a stream that waited sees it)."""

    def __init__(self, tensor: torch.Tensor, world: int):
        super().__init__()
        self._tensor, self._world, self._landed = tensor, world, False
        self.set_result(tensor)

    def wait(self):
        if not self._landed:
            self._tensor.mul_(self._world)   # every rank held the same values: their sum
            self._landed = True
        return super().wait()


class _Bucket:
    def __init__(self, grads):
        self._buffer = torch.cat([g.flatten() for g in grads])
        self._grads = grads

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float64])
def test_ddp_hook_result_waits_for_every_collective(monkeypatch, world, reduce_dtype):
    """The hook's future must hand DDP the bucket only through the collectives' own futures: with
    NCCL, a future that merely collects theirs (torch.futures.collect_all) is ready before the sums
    are, and DDP trained on half-reduced gradients on GPUs while every gloo test passed."""
    from gdn_parallel.parallel import data_parallel

    queued = []

    def all_reduce(tensor, group=None, async_op=False):
        future = _QueuedSum(tensor, world)
        queued.append(future)
        return type("Work", (), {"get_future": lambda self: future})()

    monkeypatch.setattr(data_parallel.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(data_parallel.dist, "get_world_size", lambda group=None: world)
    g = generator(7)
    grads = [torch.randn(n, generator=g) for n in (5, 3, 8)]
    bucket = _Bucket(grads)
    expected = bucket.buffer().clone() * world
    result = data_parallel._sum_allreduce_hook((None, reduce_dtype), bucket).wait()
    assert len(queued) == (1 if world <= 2 else len(grads))
    assert result.data_ptr() == bucket.buffer().data_ptr()
    assert torch.equal(result, expected)


# Cases run in launches shared by world size across the modules (tests/parallel/launcher.py, SharedLaunch).
DP_CASES = SharedLaunch({"dp2_cp2_two_process": (2, two_process_cases), "normalizers": (2, _normalizers),
                         "gathered": (2, _gathered_step),
                         "dp2_cp2": (4, dp2_cp2_cases), "clip": (4, clip_cases)})
