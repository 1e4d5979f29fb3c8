"""Fixtures shared by the kernel tests."""
import math

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """Fresh float buffers (torch.empty, torch.empty_like) start as NaN, so an output element the
    kernels skip shows up."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_filled(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_filled(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_filled(empty_like(*a, **k)))
