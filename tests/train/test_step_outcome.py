"""A non-finite step is skipped on the device when the optimizer is fused (train/step_outcome.py): the
update, the moments and the step count stay as they were, the host learns it from a flag read later,
and deciding reads no device value on the host. The trainer then books the skip a step later with the
same result as a synchronous check (tests/train/test_faults.py covers the non-fused path)."""
import copy
import json
import math

import pytest
import torch

from gdn_parallel.train import optim, step_outcome
from gdn_parallel.train.step_outcome import step_unless_non_finite
from tests.seeds import generator
from tests.train.test_faults import BASE, SAME_LR, parameters_after, poison_steps
from tests.train.test_host_reads import OnDevice


def _model_and_optimizer(fused: bool):
    gen = generator(21)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)),
              torch.nn.Parameter(torch.randn(3, generator=gen))]
    return params, torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=fused)


def _set_grads(params, seed):
    gen = generator(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bad", ["loss", "grad_norm"])
def test_a_non_finite_step_changes_nothing_and_says_so(fused, bad):
    params, optimizer = _model_and_optimizer(fused)
    twin_params = copy.deepcopy(params)
    twin = torch.optim.AdamW(twin_params, lr=0.1, weight_decay=0.1, fused=fused)
    applied = []
    for seed, poisoned in ((1, False), (2, True), (3, False)):
        _set_grads(params, seed)
        loss, norm = torch.tensor(1.0), torch.tensor(2.0)
        if poisoned:
            loss, norm = (loss * math.nan, norm) if bad == "loss" else (loss, norm * math.inf)
        applied.append(step_unless_non_finite(optimizer, seed, loss, 0.1, norm).applied())
        if not poisoned:  # the twin sees only the finite steps
            _set_grads(twin_params, seed)
            twin.step()
    assert applied == [True, False, True]
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        state, twin_state = optimizer.state[p], twin.state[q]
        assert all(torch.equal(torch.as_tensor(state[k]), torch.as_tensor(twin_state[k])) for k in state)
    assert not hasattr(optimizer, "found_inf")  # nothing left behind for a later step


def test_the_fused_decision_reads_nothing_on_the_host():
    params, optimizer = _model_and_optimizer(fused=True)
    _set_grads(params, 4)
    loss = torch.tensor(math.nan).as_subclass(OnDevice)
    norm = torch.tensor(1.0).as_subclass(OnDevice)
    outcome = step_unless_non_finite(optimizer, 0, loss, 0.1, norm)  # fails on a host read
    # (read later, on a GPU from pinned host memory that the device wrote: here the stand-in unwrapped)
    assert not bool(outcome.applied_flag._host.as_subclass(torch.Tensor))


def test_the_trainer_books_a_device_skipped_step_as_before(tmp_path, monkeypatch):
    """The fused (device-gated) path through the trainer: the weights of a run whose third step is
    poisoned equal a two-step run's, and the skip is recorded."""
    def fused_everywhere(params, train_config, device):
        return torch.optim.AdamW(optim.param_groups(params, train_config.weight_decay), lr=train_config.lr,
                                 betas=(train_config.beta1, train_config.beta2), fused=True)
    monkeypatch.setattr("gdn_parallel.train.run_setup.build_optimizer", fused_everywhere)
    decided = []
    real = step_outcome._takes_found_inf
    monkeypatch.setattr(step_outcome, "_takes_found_inf", lambda opt: decided.append(real(opt)) or real(opt))
    from gdn_parallel.train.__main__ import run
    # lines at the first and last steps: booked a step late
    sparse = [*BASE, *SAME_LR, "--set", "train.log_every=5"]
    clean = tmp_path / "clean"
    run(["--steps", "2", *sparse, "--set", f"train.out_dir={clean}"])
    poisoned = tmp_path / "poisoned"
    poison_steps(monkeypatch, {2})
    assert run(["--steps", "3", *sparse, "--set", f"train.out_dir={poisoned}"])["steps"] == 3
    assert decided and all(decided)
    records = [json.loads(line) for line in (poisoned / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("skipped_step") and r["step"] == 2 for r in records)
    assert not any(r.get("loss") is not None and r.get("step") == 2 for r in records)  # not booked as run
    before, after = parameters_after(clean), parameters_after(poisoned)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
