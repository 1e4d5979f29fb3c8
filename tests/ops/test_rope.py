"""RoPE: per-document positions and the rotate_half layout against a complex-number formulation."""
import pytest
import torch

from gdn_parallel.ops.rope import apply_rotary, document_ids_from_cu_seqlens, positions_from_cu_seqlens
from tests.seeds import generator


def test_positions_and_document_ids_reset_per_document():
    cu = torch.tensor([0, 3, 4, 9])
    assert positions_from_cu_seqlens(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert document_ids_from_cu_seqlens(cu, 9).tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    single = torch.tensor([0, 5], dtype=torch.int32)
    assert positions_from_cu_seqlens(single, 5).tolist() == [0, 1, 2, 3, 4]
    assert positions_from_cu_seqlens(single, 5).dtype == torch.int64


def test_positions_reject_bad_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens"):
        positions_from_cu_seqlens(torch.tensor([0, 3, 8]), 9)
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_ids_from_cu_seqlens(torch.tensor([1, 9]), 9)


def _rotary_complex(x, pos, theta):
    """Independent formulation: channel pairs (i, i + D/2) as complex numbers times e^{i pos w_i}."""
    D = x.shape[-1]
    half = D // 2
    w = torch.tensor([theta ** (-2.0 * i / D) for i in range(half)], dtype=torch.float64)
    phase = torch.polar(torch.ones(pos.shape + (half,), dtype=torch.float64), pos.double().unsqueeze(-1) * w)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * phase.unsqueeze(-2)
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rotary_matches_complex_rotation(theta):
    g = generator(0)
    x = torch.randn(2, 7, 3, 8, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 50, (2, 7), generator=g)
    out = apply_rotary(x, pos, theta)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, _rotary_complex(x, pos, theta), atol=1e-5, rtol=1e-5)  # fp32 angles


def test_rotary_shared_positions_and_dtype():
    g = generator(1)
    x = torch.randn(2, 5, 2, 4, generator=g).to(torch.bfloat16)
    pos = torch.arange(5)
    out = apply_rotary(x, pos)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, apply_rotary(x, pos.expand(2, 5)))
    torch.testing.assert_close(out.float(), _rotary_complex(x.float(), pos.expand(2, 5), 10000.0).float(),
                               atol=2e-2, rtol=2e-2)
    # position 0 is the identity
    torch.testing.assert_close(out[:, 0], x[:, 0])


def test_rotary_packed_documents_restart_phases():
    g = generator(2)
    x = torch.randn(1, 6, 2, 4, generator=g)
    cu = torch.tensor([0, 2, 6])
    out = apply_rotary(x, positions_from_cu_seqlens(cu, 6))
    torch.testing.assert_close(out[:, 2:], apply_rotary(x[:, 2:], torch.arange(4)))


def test_rotary_rejects_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        apply_rotary(torch.randn(1, 4, 2, 5), torch.arange(4))
    with pytest.raises(ValueError, match="x"):
        apply_rotary(torch.randn(4, 2, 6), torch.arange(4))
    with pytest.raises(ValueError, match="position_ids"):
        apply_rotary(torch.randn(1, 4, 2, 6), torch.arange(5))
    with pytest.raises(ValueError, match="position_ids"):
        apply_rotary(torch.randn(1, 4, 2, 6), torch.arange(4.0))
    with pytest.raises(ValueError, match="impl must be one of"):
        apply_rotary(torch.randn(1, 4, 2, 6), torch.arange(4), impl="triton")
