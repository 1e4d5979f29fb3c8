"""Pipeline parallelism (1F1B, interleaved, pp x cp, and the fused linear cross-entropy also under
pp x tp) equals one process: the loss, every parameter gradient (on the pp rank that holds the
parameter) and the parameters after two AdamW steps; plus the layer balancing of the stages."""
import copy
import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gdn_parallel.config import ConfigError, ModelConfig, ParallelConfig
from gdn_parallel.data.packing import PackedBatch
from gdn_parallel.model import HybridLM
from gdn_parallel.ops.rope import positions_from_cu_seqlens
from gdn_parallel.parallel.batch import all_reduce_gradients, shard_batch
from gdn_parallel.parallel.pipeline import (
    PipelineRunner,
    StageModule,
    build_pipeline,
    stage_costs,
    stage_ids_for_rank,
    stage_layer_ranges,
)
from gdn_parallel.parallel.tensor import apply_tensor_parallel, full_tensor, reduce_tp_partial_grads
from tests.compare import assert_close_set, rel_err
from tests.parallel.launcher import SharedLaunch, run_workers
from tests.seeds import generator, seed_torch

TOTAL = 32   # tokens of one microbatch row

# Two steps, four microbatches each; every microbatch has its own document layout, so a stage
# that ran a microbatch with another microbatch's sequence info would not match.
LAYOUTS = [
    [[0, 5, 19, 20, TOTAL], [0, TOTAL], [0, 1, 16, 31, TOTAL], [0, 9, 24, TOTAL]],
    [[0, 12, TOTAL], [0, 2, 3, 30, TOTAL], [0, 16, TOTAL], [0, 7, 8, 17, 29, TOTAL]],
]


def make_batch(cu, seed):
    gen = generator(seed)
    ids = torch.randint(0, 64, (1, TOTAL), generator=gen)
    labels = torch.full_like(ids, -100)
    for s, e in itertools.pairwise(cu):
        labels[0, s:e - 1] = ids[0, s + 1:e]
    cu_t = torch.tensor(cu)
    return PackedBatch(ids, labels, positions_from_cu_seqlens(cu_t, TOTAL).unsqueeze(0), cu_t)


def model_config(tie=False, fused=False):
    # G, S and A layers; the window (5) is shorter than the documents, so SWA halos matter.
    return ModelConfig(vocab_size=64, hidden_size=32, n_layers=4, layer_pattern="GSAG", gdn_num_heads=2,
                       gdn_num_v_heads=4, gdn_head_dim=8, attn_num_heads=4, attn_num_kv_heads=2,
                       window_size=5, gdn_chunk_size=8, intermediate_size=48, tie_word_embeddings=tie,
                       fused_linear_cross_entropy=fused)


def reference_step(model, batches):
    """Single process: the global-mean loss over all microbatches, one backward."""
    total = sum(int((b.labels != -100).sum()) for b in batches)
    loss_sum = sum(model(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens).loss_sum for b in batches)
    loss = loss_sum / total
    loss.backward()
    return loss.detach()


def train_equal(pp_rank, parallel, n_mb, pp_group=None, cp_group=None, cp_rank=0, tie=False, fused=False,
                tp_group=None):
    """fused: the pipelined model uses the fused linear cross-entropy, the reference the default
    criterion. tp_group: tensor parallelism inside the stages (gradients and parameters compared
    all-gathered to full shape)."""
    seed_torch(0)
    reference = HybridLM(model_config(tie)).double()
    model = copy.deepcopy(reference)
    if fused:
        parallel.validate(model_config(tie, fused=True))   # the option is accepted with pp > 1
        model = HybridLM(model_config(tie, fused=True)).double()
        model.load_state_dict(reference.state_dict())
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group)   # before the split, as parallelize() does
    assert model.criterion.fuses_lm_head == fused   # under tp: VocabParallelLinearCrossEntropy

    def full(t, p):   # a collective under tp: every tp rank of a pp rank compares the same names
        return t if tp_group is None else full_tensor(t, p, tp_group)

    runner = build_pipeline(model, parallel, "cpu", pp_group=pp_group, seq_len=TOTAL)
    names = {id(p): n for n, p in model.named_parameters()}
    local = {names[id(p)] for p in runner.parameters()}
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, weight_decay=0.1)
    tag = (f"pp_rank={pp_rank} cp_rank={cp_rank} {parallel.pp_schedule} v={parallel.virtual_stages} "
           f"fused={fused} tp={parallel.tp}")
    for step, layouts in enumerate(LAYOUTS):
        batches = [make_batch(cu, seed=10 * step + i) for i, cu in enumerate(layouts[:n_mb])]
        ref_loss = reference_step(reference, batches)
        normalizer = sum(int((b.labels != -100).sum()) for b in batches)
        if cp_group is None:
            microbatches = batches
        else:
            microbatches = [shard_batch(b, cp_rank, parallel.cp, group=cp_group) for b in batches]
        loss = runner.step(microbatches, normalizer)
        if cp_group is not None:
            dist.all_reduce(loss, group=cp_group)
            all_reduce_gradients(model, cp_group)
        if tp_group is not None:
            reduce_tp_partial_grads(model, tp_group)
        assert rel_err(loss, ref_loss) < 1e-12, f"loss step={step} {tag}"   # a loss near log(vocab)
        held = []   # (name, reference parameter, parameter) of this rank's stages
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            if name in local:
                assert p.grad is not None, f"{name} has no grad, {tag}"
                held.append((name, p_ref, p))
            else:
                assert p.grad is None, f"{name} is not on this rank but got a gradient, {tag}"
        assert_close_set({name: full(p.grad, p) for name, _, p in held},
                         {name: p_ref.grad for name, p_ref, _ in held}, 1e-9, f"grads step={step}, {tag}")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_close_set({name: full(p.detach(), p) for name, _, p in held},
                         {name: p_ref.detach() for name, p_ref, _ in held}, 1e-9, f"after step={step}, {tag}")
    # Forward only (evaluation) on the trained parameters.
    with torch.no_grad():
        ref_loss = sum(reference(b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens).loss_sum
                       for b in batches) / normalizer
    loss = runner.evaluate(microbatches, normalizer)
    if cp_group is not None:
        dist.all_reduce(loss, group=cp_group)
    assert rel_err(loss, ref_loss) < 1e-12, f"evaluate, {tag}"
    assert all(p.grad is None for p in model.parameters())
    return sorted(local)


def pp_cases(rank, world):
    results = {}
    for schedule, virtual in (("1f1b", 1), ("interleaved", 2)):
        parallel = ParallelConfig(pp=world, pp_schedule=schedule, virtual_stages=virtual)
        results[schedule] = train_equal(rank, parallel, len(LAYOUTS[0]))
    # Tied embeddings: the weight lives on the first and the last stage (two ranks).
    parallel = ParallelConfig(pp=world, pp_schedule="1f1b")
    results["tied"] = train_equal(rank, parallel, len(LAYOUTS[0]), tie=True)
    # The fused linear cross-entropy on the last stage (tied: its weight is the embedding's).
    for tie in (False, True):
        results[f"fused tie={tie}"] = train_equal(rank, parallel, len(LAYOUTS[0]), tie=tie, fused=True)
    return results


def test_pipeline_pp2_1f1b_and_interleaved_match_single_process():
    results = run_workers(pp_cases, 2)
    for case in ("1f1b", "interleaved", "tied", "fused tie=False", "fused tie=True"):
        held = [set(r[case]) for r in results]
        tied = case in ("tied", "fused tie=True")
        everything = {n for n, _ in HybridLM(model_config(tie=tied)).named_parameters()}
        assert held[0] | held[1] == everything, case
        if not tied:
            assert not held[0] & held[1], case      # each parameter lives on exactly one pp rank
    # 1F1B: rank 0 holds the embeddings, rank 1 the head. Interleaved: 4 stages of one layer, rank 0
    # holds stages 0 and 2, rank 1 stages 1 and 3 (with the head).
    assert "embeddings.weight" in results[0]["1f1b"] and "lm_head.weight" in results[1]["1f1b"]
    layers = [{n.split(".")[1] for n in r["interleaved"] if n.startswith("layers.")} for r in results]
    assert layers == [{"0", "2"}, {"1", "3"}], layers
    assert "embeddings.weight" in results[0]["interleaved"] and "lm_head.weight" in results[1]["interleaved"]


def pp_cp_case(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pp_group, cp_group = mesh.get_group("pp"), mesh.get_group("cp")
    parallel = ParallelConfig(pp=2, cp=2, pp_schedule="1f1b")
    train_equal(mesh.get_local_rank("pp"), parallel, 2, pp_group=pp_group, cp_group=cp_group,
                cp_rank=mesh.get_local_rank("cp"))
    parallel = ParallelConfig(pp=2, cp=2, pp_schedule="interleaved", virtual_stages=2)
    train_equal(mesh.get_local_rank("pp"), parallel, len(LAYOUTS[0]), pp_group=pp_group, cp_group=cp_group,
                cp_rank=mesh.get_local_rank("cp"))
    return True


def test_pipeline_pp2_cp2_matches_single_process():
    assert all(PIPELINE_CASES("pp2_cp2"))


def pp_tp_fused_case(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    parallel = ParallelConfig(pp=2, tp=2, pp_schedule="1f1b")
    train_equal(mesh.get_local_rank("pp"), parallel, 2, pp_group=mesh.get_group("pp"), fused=True,
                tp_group=mesh.get_group("tp"))
    return True


def test_pipeline_pp2_tp2_fused_linear_cross_entropy_matches_single_process():
    # Under tp the last stage's criterion is VocabParallelLinearCrossEntropy (lm_head split by vocab).
    assert all(PIPELINE_CASES("pp2_tp2_fused"))


# Cases run in launches shared by world size across the modules (tests/parallel/launcher.py, SharedLaunch).
PIPELINE_CASES = SharedLaunch({"pp2_cp2": (4, pp_cp_case), "pp2_tp2_fused": (4, pp_tp_fused_case)})


# ------------------------------------------------------------------------- no processes
def test_pp1_runner_is_gradient_accumulation():
    seed_torch(0)
    reference = HybridLM(model_config()).double()
    model = copy.deepcopy(reference)
    runner = PipelineRunner(model, ParallelConfig(), "cpu")
    batches = [make_batch(cu, seed=i) for i, cu in enumerate(LAYOUTS[0])]
    ref_loss = reference_step(reference, batches)
    loss = runner.step(batches, sum(int((b.labels != -100).sum()) for b in batches))
    assert rel_err(loss, ref_loss) < 1e-12   # a loss near log(vocab)
    assert_close_set({name: p.grad for name, p in model.named_parameters()},
                     {name: p.grad for name, p in reference.named_parameters()}, 1e-9, "grads")


def test_stage_module_needs_its_microbatch():
    model = HybridLM(model_config())
    stage = StageModule(model, 1, 2, (2, 4))
    with pytest.raises(RuntimeError, match="without knowing its microbatch"):
        stage(torch.zeros(1, TOTAL, 32))
    assert next(n for n, _ in stage.named_parameters()).startswith("layers.2.")


@pytest.mark.parametrize("in_fp32", [True, False])
def test_stages_send_the_residual_stream_in_its_training_dtype(in_fp32):
    """model.residual_in_fp32=false under bf16 autocast: the stages send bf16 (half the bytes) and their
    blocks see the stream one device's model sees, bit for bit (the first stage's embedding output
    and a stream that arrives in fp32 are rounded as there); true: fp32 throughout."""
    seed_torch(5)
    model = HybridLM(dataclasses.replace(model_config(), residual_in_fp32=in_fp32))
    stream = torch.float32 if in_fp32 else torch.bfloat16
    first = StageModule(model, 0, 2, (0, 2), stream_dtype=stream)
    last_blocks = StageModule(model, 1, 3, (2, 4), stream_dtype=stream)
    batch = make_batch(LAYOUTS[0][0], seed=0)
    seq = model.sequence_info(batch.input_ids, batch.cu_seqlens, batch.position_ids)
    outputs = {}
    hooks = [model.layers[i].register_forward_hook(lambda m, a, out, i=i: outputs.setdefault(i, out))
             for i in (1, 3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch.input_ids, seq=seq)
        for h in hooks:
            h.remove()
        sent = first(batch.input_ids, seq=seq)
        received = last_blocks(sent.float(), seq=seq)  # as a stage built without the stream dtype sends it
    assert first.hidden_dtype == last_blocks.hidden_dtype == sent.dtype == received.dtype == stream
    assert torch.equal(sent, outputs[1]) and torch.equal(received, outputs[3])


def _check_ranges(ranges, n_layers, num_stages):
    assert len(ranges) == num_stages
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start
    assert all(b - a >= 1 for a, b in ranges)


def test_stage_layer_ranges_balance_the_cost():
    # Identical layers, negligible embedding/head: an even split.
    uniform = ModelConfig(vocab_size=8, hidden_size=64, n_layers=8, layer_pattern="G", gdn_head_dim=16)
    assert stage_layer_ranges(uniform, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layer_ranges(uniform, 8) == [(i, i + 1) for i in range(8)]
    assert stage_layer_ranges(uniform, 1) == [(0, 8)]
    # A large vocabulary: the first and last stage (embedding, lm_head) get fewer layers.
    big_vocab = ModelConfig(vocab_size=4096, hidden_size=64, n_layers=12, layer_pattern="G",
                            gdn_head_dim=16)
    layers, first, last = stage_costs(big_vocab)
    assert first > layers[0] and last > first
    ranges = stage_layer_ranges(big_vocab, 4)
    _check_ranges(ranges, 12, 4)
    sizes = [b - a for a, b in ranges]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[2], ranges
    # Mixed layers: full attention costs more with longer rows, so it gets a stage of its own.
    mixed = ModelConfig(vocab_size=8, hidden_size=64, n_layers=6, layer_pattern="GGGGGA", gdn_head_dim=16)
    short = stage_layer_ranges(mixed, 2, seq_len=64)
    long = stage_layer_ranges(mixed, 2, seq_len=1 << 20)
    _check_ranges(short, 6, 2)
    assert long == [(0, 5), (5, 6)] and short[0][1] < 5
    # The bottleneck is optimal: no contiguous split has a cheaper most-expensive stage.
    for config, stages in ((big_vocab, 3), (mixed, 3), (model_config(), 2)):
        layers, first, last = stage_costs(config)
        ranges = stage_layer_ranges(config, stages)
        _check_ranges(ranges, config.n_layers, stages)

        def bottleneck(rs, layers=layers, first=first, last=last):
            costs = [sum(layers[a:b]) for a, b in rs]
            costs[0] += first
            costs[-1] += last
            return max(costs)

        best = min(bottleneck(list(zip((0,) + cuts, cuts + (config.n_layers,))))
                   for cuts in itertools.combinations(range(1, config.n_layers), stages - 1))
        assert bottleneck(ranges) == pytest.approx(best)
    with pytest.raises(ConfigError, match="n_layers=4 < pipeline stages"):
        stage_layer_ranges(model_config(), 5)


def test_stage_ids_for_rank():
    assert stage_ids_for_rank(1, 4, 1) == [1]
    assert stage_ids_for_rank(1, 4, 3) == [1, 5, 9]
