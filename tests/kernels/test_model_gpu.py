"""The model on a GPU takes every fused kernel (GDN, conv, norms, fused loss) in fp32; the same model
in float64 takes the PyTorch paths. They must agree: loss and every parameter gradient."""
import pytest
import torch

from gdn_parallel.config import ModelConfig
from gdn_parallel.model import HybridLM
from tests.kernels.helpers import gpu_only, rel_err
from tests.seeds import seed_torch


@gpu_only
@pytest.mark.gpu
def test_model_with_fused_kernels_matches_float64_torch_paths():
    config = ModelConfig(vocab_size=512, hidden_size=256, n_layers=4, layer_pattern="GSGA", gdn_num_heads=4,
                         gdn_head_dim=64, attn_num_heads=4, window_size=128, intermediate_size=512,
                         fused_linear_cross_entropy=True, attn_impl="sdpa")  # flex has no float64
    seed_torch(0)
    model = HybridLM(config).cuda()
    reference = HybridLM(config).cuda().double()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 512, (1, 1000), device="cuda")
    cu = torch.tensor([0, 300, 301, 1000], device="cuda")
    losses = []
    for m in (model, reference):
        out = m(ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        losses.append(out.loss.item())
    assert abs(losses[0] - losses[1]) / losses[1] < 1e-3
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        err = rel_err(p.grad, p_ref.grad)
        assert err < 1e-2, f"{name}: gradient relative error {err:.2e}"
