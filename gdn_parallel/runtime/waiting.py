"""Lines a rank prints while it waits for its peers at start-up, so that a job whose other processes
never started is not silent for the whole train.collective_timeout_s before its error.

Joining the process group blocks inside torch.distributed (rank 0's store waits for every client; the
others connect to it, then gloo connects every pair, NCCL meets at the first collective), which
releases the GIL: a thread beside it prints a line after WAIT_NOTICE_FIRST_S and then every
WAIT_NOTICE_EVERY_S until the join ends. torch does not say which ranks are missing (rank 0's store
counts its clients only), so the line names how many.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

WAIT_NOTICE_FIRST_S = 10.0
WAIT_NOTICE_EVERY_S = 30.0


def waiting_line(rank: int, world_size: int, address: str, waited_s: float, timeout_s: float) -> str:
    """What rank `rank` says after waiting `waited_s` seconds to join its job at `address`."""
    others = world_size - 1
    return (f"wait  | rank {rank} of {world_size}: waited {waited_s:.0f} s of train.collective_timeout_s="
            f"{timeout_s:g} s for the other {others} rank{'s' if others != 1 else ''} of the job at "
            f"{address}; each of the {world_size} processes must start and reach {address} (see the "
            f"launcher's output on every node)")


@contextlib.contextmanager
def waiting_notices(line: Callable[[float], str], say: Callable[[str], None] | None = None,
                    first_s: float | None = None, every_s: float | None = None,
                    clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Inside the block, a thread says `line(seconds waited)` after `first_s` and then every `every_s`
    (module defaults) until the block ends; `say` defaults to a flushed print."""
    say = say or (lambda text: print(text, flush=True))
    first_s = WAIT_NOTICE_FIRST_S if first_s is None else first_s
    every_s = WAIT_NOTICE_EVERY_S if every_s is None else every_s
    done, start = threading.Event(), clock()

    def notify() -> None:
        delay = first_s
        while not done.wait(delay):
            say(line(clock() - start))
            delay = every_s

    thread = threading.Thread(target=notify, name="gdn-waiting-notices", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
