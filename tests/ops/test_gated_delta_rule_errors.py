"""Bad inputs fail early with a ValueError that names the argument."""
import sys

import pytest
import torch

from gdn_parallel.ops.gated_delta_rule import gated_delta_rule, summarize_segment
from tests.ops.gdn_inputs import gdn_inputs
from tests.seeds import generator


def base(B=1, T=8, H=2, HV=2, K=4, V=4):
    return gdn_inputs(B, T, H, HV, K, V, dtype=torch.float32, requires_grad=False)


def call(q, k, v, g, beta, h0=None, **kw):
    return gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)


def test_k_shape_mismatch():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="k has shape"):
        call(q, k[:, :, :1], v, g, beta)


def test_dtype_mismatch():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="dtype"):
        call(q, k, v.double(), g, beta)


def test_value_heads_not_multiple():
    q, k, v, g, beta, _ = base(H=2, HV=3)
    with pytest.raises(ValueError, match="multiple"):
        call(q, k, v, g, beta)


def test_head_dim_too_large():
    q, k, v, g, beta, _ = base(K=257)
    with pytest.raises(ValueError, match="256"):
        call(q, k, v, g, beta)


def test_positive_g():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="g is the log decay"):
        call(q, k, v, g.abs() + 0.1, beta)


def test_g_and_beta_shapes():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="^g must"):
        call(q, k, v, g[:, :-1], beta)
    with pytest.raises(ValueError, match="^beta must"):
        call(q, k, v, g, beta[..., :1])


@pytest.mark.parametrize("cu,match", [
    ([1, 4, 8], "start at 0"),
    ([0, 4, 4, 8], "be strictly increasing"),
    ([0, 5, 3, 8], "be strictly increasing"),
    ([0, 4, 7], "end at"),
])
def test_bad_cu_seqlens(cu, match):
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match=f"cu_seqlens must {match}"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor(cu))


def test_boundaries_are_read_once_per_tensor_and_again_after_an_edit(monkeypatch):
    """Every layer of a row checks the same cu_seqlens: its values are read once (a device sync per
    read where they live on a GPU), the int64 copy of int32 boundaries is one tensor for every layer
    (so that the device copies derived from it are made once too), and an in-place edit, or a bad
    tensor seen before, is checked again."""
    from gdn_parallel.ops import validation
    reads = []
    original = validation._checked_boundaries
    monkeypatch.setattr(validation, "_checked_boundaries", lambda *a: reads.append(a) or original(*a))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    first = validation.check_cu_seqlens(cu, 1, 8)
    assert first.dtype == torch.int64 and first.tolist() == [0, 3, 8]
    assert all(validation.check_cu_seqlens(cu, 1, 8) is first for _ in range(3)) and len(reads) == 1
    with pytest.raises(ValueError, match="must end at the sequence length 9"):
        validation.check_cu_seqlens(cu, 1, 9)      # another length: checked on its own
    cu[1] = 9                                      # now out of order: the edit is seen
    for _ in range(2):
        with pytest.raises(ValueError, match="strictly increasing"):
            validation.check_cu_seqlens(cu, 1, 8)
    int64 = torch.tensor([0, 8])
    assert validation.check_cu_seqlens(int64, 1, 8) is int64


def test_float_cu_seqlens():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="cu_seqlens must hold integers"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 8.0]))


def test_batch_with_cu_seqlens():
    q, k, v, g, beta, _ = base(B=2)
    with pytest.raises(ValueError, match="cu_seqlens is given with batch size 2"):
        call(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens is given with batch size 2"):
        summarize_segment(k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))


def test_initial_state_shape_and_count():
    q, k, v, g, beta, h0 = base()
    with pytest.raises(ValueError, match="initial_state must have shape"):
        call(q, k, v, g, beta, h0[..., :2])
    with pytest.raises(ValueError, match="initial_state has 1 states but there are 2"):
        call(q, k, v, g, beta, h0, cu_seqlens=torch.tensor([0, 3, 8]))


def test_unknown_impl():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="impl="):
        call(q, k, v, g, beta, impl="fast")


def test_triton_without_kernels_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gdn_kernels.gated_delta_rule", None)  # as if not installed
    q, k, v, g, beta, _ = base()
    with pytest.raises(RuntimeError, match="impl='triton' needs"):
        call(q, k, v, g, beta, impl="triton")


def test_triton_rejects_float64():
    q, k, v, g, beta, _ = gdn_inputs(1, 8, 2, 2, 4, 4, dtype=torch.float64, requires_grad=False)
    with pytest.raises(ValueError, match="impl='triton' takes float32"):
        call(q, k, v, g, beta, impl="triton")


def test_gate_activation_arguments_are_checked():
    q, k, v, g, beta, _ = base()
    with pytest.raises(ValueError, match="beta_activation='softmax'"):
        call(q, k, v, g, beta, beta_activation="softmax")
    with pytest.raises(ValueError, match="A_log must be a float tensor of shape \\[HV\\]"):
        call(q, k, v, g, beta, decay_params=(torch.zeros(3), torch.zeros(2)))
    with pytest.raises(ValueError, match="pair"):
        call(q, k, v, g, beta, decay_params=torch.zeros(2))


def test_logits_with_activations_equal_activated_inputs():
    """decay_params / beta_activation / use_qk_l2norm applied by the op = applied by hand (chunk path);
    with decay_params, g holds logits and may be positive."""
    import torch.nn.functional as F
    q, k, v, _, _, h0 = base(T=20)
    gen = generator(3)
    a, b = torch.randn(1, 20, 2, generator=gen) + 1.0, torch.randn(1, 20, 2, generator=gen)
    A_log, dt_bias = torch.rand(2, generator=gen), torch.randn(2, generator=gen)
    got, _ = call(q * 3, k * 2, v, a, b, decay_params=(A_log, dt_bias), beta_activation="2sigmoid",
                  use_qk_l2norm=True, impl="chunk", chunk_size=8)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    want, _ = call(F.normalize(q, dim=-1, eps=0), F.normalize(k, dim=-1, eps=0), v, g, 2 * b.sigmoid(),
                   impl="chunk", chunk_size=8)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
