"""Random inputs for Kimi Delta Attention tests."""
import torch
import torch.nn.functional as F

from tests.seeds import generator


def kda_inputs(B, T, H, HV, K, V, *, dtype=torch.float64, seed=0, num_states=None, requires_grad=True,
               decay_shift=2.0):
    """q, k (unit norm), v, g (<= 0, one per value head and key channel), beta in (0, 1), initial_state:
    fresh values for a seed. `decay_shift` moves the decays: 2 keeps most near 0 (alpha near 1), a
    negative shift makes channels forget within a few tokens."""
    gen = generator(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = rand(B, T, H, K)
    k = F.normalize(rand(B, T, H, K), dim=-1)
    v = rand(B, T, HV, V)
    g = F.logsigmoid(2 * rand(B, T, HV, K) + decay_shift)   # spread over channels: some keep, some forget
    beta = torch.sigmoid(rand(B, T, HV))
    h0 = rand(num_states or B, HV, K, V)
    tensors = [q, k, v, g, beta, h0]
    if requires_grad:
        for x in tensors:
            x.requires_grad_(True)
    return tensors
