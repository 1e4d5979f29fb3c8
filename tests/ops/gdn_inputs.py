"""Random inputs for gated-delta-rule tests (shared by the op and the context-parallel tests)."""
import torch
import torch.nn.functional as F

from tests.seeds import generator


def gdn_inputs(B, T, H, HV, K, V, *, dtype=torch.float64, seed=0, num_states=None, requires_grad=True):
    """q, k (unit norm), v, g (<= 0), beta in (0, 1), initial_state: fresh values for a seed."""
    gen = generator(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = rand(B, T, H, K)
    k = F.normalize(rand(B, T, H, K), dim=-1)
    v = rand(B, T, HV, V)
    g = F.logsigmoid(rand(B, T, HV) + 2.0)            # log decay in (-inf, 0), mostly near 0
    beta = torch.sigmoid(rand(B, T, HV))
    h0 = rand(num_states or B, HV, K, V)
    tensors = [q, k, v, g, beta, h0]
    if requires_grad:
        for x in tensors:
            x.requires_grad_(True)
    return tensors
