"""Every random draw of the tests is seeded through here, so that GDN_TEST_SEED_OFFSET=N shifts all
of them at once: a second seed set shakes out checks that hold only for the default draws.

The variable is read at each call, from the environment, so the worker processes that
tests/parallel/launcher.py spawns (they inherit the environment but never load conftest.py) shift
their seeds the same way as the test process."""
import os

import torch

OFFSET_VARIABLE = "GDN_TEST_SEED_OFFSET"


def seed_offset() -> int:
    return int(os.environ.get(OFFSET_VARIABLE, "0"))


def seeded(base: int) -> int:
    """The seed a test uses where it asks for `base`."""
    return base + seed_offset()


def generator(base: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seeded(base))


def seed_torch(base: int) -> None:
    """Seed torch's global generator (parameter initialisation of models built in a test)."""
    torch.manual_seed(seeded(base))
