"""HybridLM (G, K, S and A layers) under tensor parallelism (with and without sequence parallelism,
and combined with context parallelism) equals one process in float64: loss, every parameter
gradient gathered to full shape, and the parameters after two AdamW steps."""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from gdn_parallel.config import ModelConfig
from gdn_parallel.model import HybridLM
from gdn_parallel.parallel.batch import all_reduce_gradients, cp_loss, shard_batch
from gdn_parallel.parallel.tensor import (
    apply_tensor_parallel,
    full_tensor,
    reduce_tp_partial_grads,
    sequence_shard,
)
from gdn_parallel.parallel.tensor_collectives import vocab_parallel_cross_entropy
from tests.compare import assert_close_set, rel_err
from tests.parallel.batches import make_batch
from tests.parallel.launcher import SharedLaunch, run_workers
from tests.seeds import generator, seed_torch

TOTAL = 48
LAYOUTS = [[0, 5, 19, 20, 40, TOTAL], [0, 1, 30, 31, TOTAL]]


def model_config(**overrides):
    # grouped value heads (4 over 2 q/k heads), GQA (4 query heads over 2 KV heads), output gate,
    # biases on the convs and QKV so that every slicing rule is exercised.
    base = dict(vocab_size=64, hidden_size=32, n_layers=3, layer_pattern="GSA", gdn_num_heads=2,
                gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2, window_size=5,
                gdn_chunk_size=8, intermediate_size=48, attn_output_gate=True, attn_qkv_bias=True,
                conv_bias=True, kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=8, kda_chunk_size=8)
    return ModelConfig(**{**base, **overrides})


def train_equal(tp_group, sequence_parallel, config, cp_group=None, tag="", tol=1e-9):
    """Two steps on the reference (one process, full batch) and on the parallel model."""
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    seed_torch(0)
    reference = HybridLM(config).double()
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, tp_group, sequence_parallel=sequence_parallel)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    params = dict(model.named_parameters())
    rows = []  # the residual stream's row length between blocks: a piece of the row under SP
    model.layers[0].register_forward_hook(lambda _m, _args, out: rows.append(out.shape[1]))
    assert params.keys() == dict(reference.named_parameters()).keys(), "names must not change"
    for step, cu in enumerate(LAYOUTS):
        batch = make_batch(cu, seed=step)
        out = reference(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()

        if cp_group is None:
            loss = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens).loss
        else:
            shard = shard_batch(batch, cp_rank, cp_size, cp_group)
            loss = cp_loss(model, shard)
        loss.backward()
        total_loss = loss.detach().clone()
        if cp_group is not None:
            shard.context.finish()
            dist.all_reduce(total_loss, group=cp_group)
            all_reduce_gradients(model, cp_group)
        reduce_tp_partial_grads(model, tp_group)

        tp = dist.get_world_size(tp_group)
        assert rows.pop() == TOTAL // cp_size // (tp if sequence_parallel else 1)
        where = f"{tag} sp={sequence_parallel} step={step} rank={dist.get_rank()}"
        assert rel_err(total_loss, out.loss.detach()) < 1e-12, where   # a loss near log(vocab)
        assert_close_set({name: full_tensor(p.grad, p, tp_group) for name, p in params.items()},
                         {name: p_ref.grad for name, p_ref in reference.named_parameters()}, tol,
                         f"grads, {where}")
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        assert_close_set({name: full_tensor(p, p, tp_group) for name, p in params.items()},
                         {name: p_ref.detach() for name, p_ref in reference.named_parameters()}, tol,
                         f"after step, {where}")
    return True


def tp_cases(rank, world):
    group = dist.group.WORLD
    for sp in (False, True):
        train_equal(group, sp, model_config(), tag="tp2")
    # One KV head over two ranks: replicated KV projections (partial gradients); tied embeddings.
    config = model_config(attn_num_kv_heads=1, tie_word_embeddings=True)
    train_equal(group, True, config, tag="kv1")
    # Qwen3-Next's attention: query/key norms (one weight each over all heads: partial gradients, also
    # with the KV head replicated) and RoPE on half of each head.
    for kv_heads in (2, 1):
        config = model_config(attn_num_kv_heads=kv_heads, attn_qk_norm=True, attn_rotary_dim=4)
        train_equal(group, False, config, tag=f"qk_norm kv{kv_heads}")
    # Kimi Linear's pattern: KDA (its low-rank decay and output-gate inputs replicated, partial
    # gradients) beside full attention without RoPE.
    train_equal(group, True, model_config(layer_pattern="KKA", attn_rotary_dim=0), tag="kda")
    return True


def tp_cp_cases(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    for sp in (False, True):
        train_equal(mesh.get_group("tp"), sp, model_config(), cp_group=mesh.get_group("cp"), tag="tp2xcp2")
    train_equal(mesh.get_group("tp"), False, model_config(layer_pattern="KGA"), cp_group=mesh.get_group("cp"),
                tag="kda tp2xcp2")
    return True


def test_tp2_hybrid_lm_matches_single_process():
    assert all(TP_CASES("tp2"))


def test_tp2_cp2_hybrid_lm_matches_single_process():
    assert all(run_workers(tp_cp_cases, 4))


def collective_cases(rank, world):
    group = dist.group.WORLD
    # vocab-parallel cross-entropy against F.cross_entropy on the full logits, value and gradient
    gen = generator(1)
    logits = (torch.randn(3, 7, 20, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    labels = torch.randint(0, 20, (3, 7), generator=gen)
    labels[0, :3] = -100
    expected = F.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1), ignore_index=-100, reduction="sum")
    (grad_expected,) = torch.autograd.grad(2.5 * expected, logits)
    local = logits.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, group)
    (2.5 * loss).backward()
    assert rel_err(loss.detach(), expected.detach()) < 1e-12
    assert rel_err(local.grad, grad_expected.chunk(world, dim=-1)[rank]) < 1e-12
    # bf16 logits: computed in fp32, gradient returned in bf16
    local16 = local.detach().bfloat16().requires_grad_()
    loss16 = vocab_parallel_cross_entropy(local16, labels, group)
    assert loss16.dtype == torch.float32 and abs(loss16.item() - expected.item()) / expected.item() < 1e-2
    loss16.backward()
    assert local16.grad.dtype == torch.bfloat16

    # sequence_shard takes this rank's piece of the row; its backward all-gathers the gradient
    x = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3).requires_grad_()
    piece = sequence_shard(x, group)
    assert torch.equal(piece, x.detach()[:, 4 * rank:4 * rank + 4])
    (piece * (rank + 1)).sum().backward()
    assert (torch.equal(x.grad[:, :4], torch.ones(2, 4, 3))
            and torch.equal(x.grad[:, 4:], 2 * torch.ones(2, 4, 3)))
    return True


def test_vocab_parallel_cross_entropy_and_sequence_shard():
    assert all(TP_CASES("collectives"))


# Cases run in launches shared by world size across the modules (tests/parallel/launcher.py, SharedLaunch).
TP_CASES = SharedLaunch({"tp2": (2, tp_cases), "collectives": (2, collective_cases)})
