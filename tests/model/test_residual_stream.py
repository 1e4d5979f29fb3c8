"""model.residual_in_fp32: under autocast the residual stream (what each block takes and returns) is
fp32 (true, the default) or the autocast dtype (false); outside autocast nothing changes. Both train:
every parameter gets a gradient, and the two streams' losses agree to bf16's rounding."""
import pytest
import torch

from gdn_parallel.model import HybridLM, residual_stream_dtype
from gdn_parallel.model.hybrid_lm import Block
from tests.model.test_model import tiny
from tests.seeds import seed_torch


def _stream_dtypes(model, ids, autocast):
    seen = []
    hooks = [b.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
             for b in model.modules() if isinstance(b, Block)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=ids)
    out.loss.backward()
    for h in hooks:
        h.remove()
    return out.loss.detach().float(), set(seen)


@pytest.mark.parametrize("in_fp32", [True, False])
def test_the_stream_dtype_follows_the_setting_under_autocast(in_fp32):
    seed_torch(3)
    config = tiny(residual_in_fp32=in_fp32)
    model = HybridLM(config)
    ids = torch.randint(0, 64, (2, 24))
    loss, dtypes = _stream_dtypes(model, ids, autocast=True)
    expected = torch.float32 if in_fp32 else torch.bfloat16
    assert dtypes == {(expected, expected)}
    assert residual_stream_dtype(config, torch.bfloat16) == expected
    assert loss.isfinite()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # without autocast the setting changes nothing
    model.zero_grad()
    _, plain = _stream_dtypes(model, ids, autocast=False)
    assert plain == {(torch.float32, torch.float32)}
    assert residual_stream_dtype(config, None) == torch.float32


def test_both_streams_give_the_same_loss_to_bf16_rounding():
    seed_torch(4)
    fp32_stream = HybridLM(tiny(residual_in_fp32=True))
    bf16_stream = HybridLM(tiny(residual_in_fp32=False))
    bf16_stream.load_state_dict(fp32_stream.state_dict())
    ids = torch.randint(0, 64, (2, 24))
    a, _ = _stream_dtypes(fp32_stream, ids, autocast=True)
    b, _ = _stream_dtypes(bf16_stream, ids, autocast=True)
    assert a != b                                   # the stream is rounded: not the same computation
    assert abs(a - b) < 0.02 * abs(a)               # bf16's 8 bits over 3 blocks' sums
