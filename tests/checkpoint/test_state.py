"""A save that would leave out optimizer slots is refused: a parameter the optimizer has no state for
(once it has stepped) means the module shows other tensors than the optimizer's, and such a
checkpoint could never be resumed (it happened with FSDP2 after an evaluation)."""
import pytest
import torch
from torch import nn

from gdn_parallel.checkpoint.state import state_to_save


def test_a_parameter_without_optimizer_state_fails_the_save_naming_it():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    assert set(state_to_save(list(model.named_parameters()), optimizer, None)) == \
        {"model.weight", "model.bias"}
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = state_to_save(list(model.named_parameters()), optimizer, None)
    assert {"optim.weight.exp_avg", "optim.bias.exp_avg_sq", "optim.weight.step"} <= set(saved)
    stand_in = nn.Parameter(model.bias.detach().clone())   # what an unsharded FSDP2 module exposed
    with pytest.raises(RuntimeError, match=r"no optimizer state for 1 parameter\(s\) being saved \(bias\)"):
        state_to_save([("weight", model.weight), ("bias", stand_in)], optimizer, None)
