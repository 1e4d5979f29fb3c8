"""Counting the aten operators a piece of code dispatches (tests of work a change removes)."""
import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Inside, how many times each aten operator ran (`calls[torch.ops.aten.<op>.<overload>]`)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))
