"""Fused linear + cross-entropy (gdn_kernels.linear_cross_entropy) against F.cross_entropy on the
full logits: loss and both gradients, chunked and vocab-parallel, and the model's fused option
against its default criterion (single process, and tensor parallel with and without SP)."""
import dataclasses

import gdn_kernels.linear_cross_entropy as lce  # noqa: E402  (after helpers: skips without triton)
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gdn_parallel.config import IGNORE_INDEX  # noqa: E402
from gdn_parallel.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from tests.compare import assert_close_set
from tests.kernels.helpers import device, gpu_only, rel_err
from tests.seeds import generator, seed_torch

GRAD_SCALE = 2.5  # backward with a grad_output other than 1: the stored gradients are scaled


def make_inputs(n, d, vocab, dtype=torch.float32, seed=0, dev=device):
    gen = generator(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::4] = IGNORE_INDEX
    labels[1], labels[2] = 0, vocab - 1  # the first and last column (the last is in a partial block)
    return hidden.to(dev, dtype), weight.to(dev, dtype), labels.to(dev)


def reference(hidden, weight, labels, dtype=None):
    """Loss and gradients from the full logits (in `dtype`, default the inputs')."""
    h = hidden.detach().to(dtype or hidden.dtype).requires_grad_()
    w = weight.detach().to(dtype or weight.dtype).requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (GRAD_SCALE * loss).backward()
    return loss.detach(), h.grad, w.grad


def fused(hidden, weight, labels, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, **kwargs)
    (GRAD_SCALE * loss).backward()
    return loss.detach(), h.grad, w.grad


# ---------------------------------------------------------------- the op (interpreter on CPU)
@pytest.mark.parametrize("n,vocab,chunk", [
    (37, 1300, 16),    # 3 chunks, the last partial; one full and one partial vocab block
    (20, 100, 64),     # one chunk larger than N; vocab smaller than one block
])
def test_matches_full_logits_fp32(n, vocab, chunk):
    hidden, weight, labels = make_inputs(n, 16, vocab)
    loss, dh, dw = fused(hidden, weight, labels, chunk_tokens=chunk)
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(dh, ref_dh) < 1e-5
    assert rel_err(dw, ref_dw) < 1e-5


def test_leading_dims_fp16_and_no_grad():
    hidden, weight, labels = make_inputs(24, 16, 1100)
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels)
    # [B, T, D] hidden with [B, T] labels: the gradient comes back in the input's shape
    loss, dh, _ = fused(hidden.view(2, 12, 16), weight, labels.view(2, 12), chunk_tokens=10)
    assert dh.shape == (2, 12, 16) and rel_err(dh.reshape(24, 16), ref_dh) < 1e-5
    # fp16 inputs: logits and gradients in fp16, statistics and the loss in fp32
    loss16, dh16, dw16 = fused(hidden.half(), weight.half(), labels, chunk_tokens=10)
    ref16 = reference(hidden.half(), weight.half(), labels, dtype=torch.float32)
    assert loss16.dtype == torch.float32 and dh16.dtype == dw16.dtype == torch.float16
    for got, want in zip((loss16, dh16, dw16), ref16):
        assert rel_err(got, want) < 1e-2
    with torch.no_grad():  # no gradient work, same loss
        assert rel_err(linear_cross_entropy(hidden, weight, labels, chunk_tokens=7), ref_loss) < 1e-5


def test_all_ignored_gives_zero_loss_and_gradients():
    hidden, weight, labels = make_inputs(9, 8, 50)
    loss, dh, dw = fused(hidden, weight, torch.full_like(labels, IGNORE_INDEX), chunk_tokens=4)
    assert loss.item() == 0.0
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_torch_fallback_matches(monkeypatch):
    """Without CUDA and without the interpreter the per-chunk statistics run in torch."""
    hidden, weight, labels = make_inputs(21, 16, 1300)
    expected = fused(hidden, weight, labels, chunk_tokens=8)
    monkeypatch.setattr(lce, "_use_triton", lambda _x: False)
    for got, want in zip(fused(hidden, weight, labels, chunk_tokens=8), expected):
        assert rel_err(got, want) < 1e-6


# ---------------------------------------------------------------- in the model
def tiny_config(**overrides):
    from gdn_parallel.config import ModelConfig
    base = dict(vocab_size=64, hidden_size=32, n_layers=3, layer_pattern="GSA", gdn_num_heads=2,
                gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2, window_size=5,
                gdn_chunk_size=8, intermediate_size=48)
    return ModelConfig(**{**base, **overrides})


def fused_twin(config):
    """The model with the plain criterion (float64) and a copy with the fused one and the same weights.
    (`None`, the default, fuses on CUDA: so the plain one is asked for by name.)"""
    from gdn_parallel.model import HybridLM
    seed_torch(0)
    default = HybridLM(dataclasses.replace(config, fused_linear_cross_entropy=False)).double()
    fused_model = HybridLM(dataclasses.replace(config, fused_linear_cross_entropy=True)).double()
    fused_model.load_state_dict(default.state_dict())
    assert fused_model.criterion.fuses_lm_head and not default.criterion.fuses_lm_head
    return default, fused_model


@pytest.mark.parametrize("tie", [False, True])
def test_model_fused_option_matches_default(tie):
    default, fused_model = fused_twin(tiny_config(tie_word_embeddings=tie))
    gen = generator(3)
    ids = torch.randint(0, 64, (2, 19), generator=gen)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :4] = IGNORE_INDEX
    outs = []
    for model in (default, fused_model):
        out = model(ids, labels=labels)
        out.loss.backward()
        outs.append(out)
    assert outs[1].num_tokens == outs[0].num_tokens
    assert rel_err(outs[1].loss.detach(), outs[0].loss.detach()) < 1e-12
    assert_close_set({name: p.grad for name, p in fused_model.named_parameters()},
                     {name: p.grad for name, p in default.named_parameters()}, 1e-10, "grads", "l2")
    # without labels both return the logits
    assert torch.equal(fused_model(ids).logits, default(ids).logits)


def test_config_option_is_validated():
    from gdn_parallel.config import ConfigError, ParallelConfig
    with pytest.raises(ConfigError, match="fused_linear_cross_entropy"):
        tiny_config(fused_linear_cross_entropy="yes").validate()
    # Accepted with tp and pp (the last pipeline stage calls it as HybridLM does: lm_head_loss).
    for parallel in (ParallelConfig(tp=2), ParallelConfig(pp=2)):
        parallel.validate(tiny_config(fused_linear_cross_entropy=True))


# ---------------------------------------------------------------- vocab parallel (2 gloo processes)
def vocab_parallel_cases(rank, world):
    from gdn_parallel.parallel.tensor import apply_tensor_parallel, full_tensor, reduce_tp_partial_grads
    from tests.parallel.batches import make_batch
    group = dist.group.WORLD

    # The op: weight split by vocabulary rows (2 x 1100: two vocab blocks per rank, labels on both).
    hidden, weight, labels = make_inputs(30, 16, 2 * 1100, dev="cpu")
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels)
    v_local = weight.shape[0] // world
    shard = weight[rank * v_local:(rank + 1) * v_local]
    loss, dh, dw = fused(hidden, shard, labels, vocab_start=rank * v_local, group=group, chunk_tokens=12)
    dist.all_reduce(dh, group=group)  # the partials, summed as copy_to_tp's backward does
    assert rel_err(loss, ref_loss) < 1e-5, rank
    assert rel_err(dh, ref_dh) < 1e-5, rank
    assert rel_err(dw, ref_dw[rank * v_local:(rank + 1) * v_local]) < 1e-5, rank

    # The model: fused criterion under tp (and SP) against the default single-process model.
    for sp in (False, True):
        default, model = fused_twin(tiny_config())
        apply_tensor_parallel(model, group, sequence_parallel=sp)
        assert model.criterion.fuses_lm_head
        batch = make_batch([0, 5, 19, 20, 40, 48], seed=1)
        ref = default(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        ref.loss.backward()
        out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)
        out.loss.backward()
        reduce_tp_partial_grads(model, group)
        assert rel_err(out.loss.detach(), ref.loss.detach()) < 1e-12, (rank, sp)
        assert_close_set({name: full_tensor(p.grad, p, group) for name, p in model.named_parameters()},
                         {name: p.grad for name, p in default.named_parameters()}, 1e-10,
                         f"grads, rank {rank} sp={sp}", "l2")
    return True


def test_vocab_parallel_matches_single_process():
    from tests.parallel.launcher import run_workers
    assert all(run_workers(vocab_parallel_cases, 2))


# ---------------------------------------------------------------- GPU: bf16 at scale, memory
@gpu_only
@pytest.mark.gpu
def test_bf16_large_against_fp32_and_memory():
    n, d, vocab = 16384, 2048, 32000
    gen = generator(0, "cuda")
    hidden = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, d, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    labels[::7] = IGNORE_INDEX
    ref = reference(hidden, weight, labels, dtype=torch.float32)
    ref = [t.cpu() for t in ref]  # the fp32 logits and their gradient are gone before measuring
    torch.cuda.empty_cache()

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(h, w, labels)
    (GRAD_SCALE * loss).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_logits = n * vocab * 4  # one fp32 copy of the logits; the unfused path holds several
    for got, want in zip((loss, h.grad, w.grad), ref):
        assert rel_err(got.float().cpu(), want) < 1e-2
    assert extra < full_logits / 2, f"peak +{extra / 2**20:.0f} MiB; fp32 logits: {full_logits / 2**20:.0f}"
